"""Dropout of attention weights and their product with the values in one Pallas kernel:
``dropout(weights) @ value``, as models with eager attention write it
(``torch.matmul(dropout(softmax(scores)), value)``).

Apart, the dropout kernel writes the dropped weights (``*batch x L x S``) to memory, the
matrix product reads them back, and autograd keeps them for the value's gradient. Here the
forward kernel reads the weights once and writes only ``(*batch, L, Ev)``; the backward kernel
regenerates the mask from the 8-byte key and writes the weights' gradient and the value's.
Nothing of size ``L x S`` is saved but the weights themselves, which the softmax before them
keeps anyway.

The mask is the one :mod:`torch_pallas.kernels.attention`'s kernels draw for ``(*batch, L,
S)`` weights (:func:`attention.kept_weights`): with ``impl="threefry"`` bit for bit
``jax.random.bernoulli(key, 1 - p, weights.shape)``, so :func:`dropout.dropout`'s mask for the
same key; with the per-tile impls (``"hardware"``, ``"tiled"``) drawn per
:func:`attention.attention_tile`, which is not :func:`dropout.dropout`'s mask of those impls
(drawn per tile of a lane-dense view of the whole tensor). A kept weight is ``weights / (1 -
p)`` (:func:`prng.keep_probability`) rounded to the weights' dtype, as the dropout kernel
computes it; the products accumulate in float32.

With ``softmax=True`` the kernels take the scores instead and apply ``softmax(scores, -1)``
first, whole rows per block: ``dropout(softmax(scores)) @ value``, eager attention's three
calls in one. Then nothing of size ``L x S`` is materialised but the scores (which the
backward kernel recomputes the weights from), where apart XLA keeps the softmax's
exponentials for its own backward fusion beside the weights the kernel reads.

Short planes of heads, ``(B, H, L, S)`` weights with a ``(B, H, S, E)`` value that
:func:`heads_in_lanes.takes_weights` accepts (BERT's and GPT-2's 128 tokens, ViT's 197 patches),
run on the value, the output and their gradients as a model's projections hold them,
``(B, S, H * E)`` (:mod:`heads_in_lanes`): the same mask, values and weights' gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import arguments, attention, calls, heads_in_lanes, prng, tiling
from torch_pallas.kernels.dropout import kept_values


def check_shapes(weights_shape, value_shape) -> None:
    """Raises ValueError unless ``weights (*batch, L, S)`` and ``value (*batch, S, Ev)`` share
    their batch dims (no broadcasting) and ``S``."""
    if (len(weights_shape) < 2 or len(value_shape) != len(weights_shape)
            or tuple(weights_shape[:-2]) != tuple(value_shape[:-2]) or weights_shape[-1] != value_shape[-2]):
        raise ValueError(f"weights (*batch, L, S) and value (*batch, S, Ev) must share their batch dims and S, "
                         f"got {tuple(weights_shape)} and {tuple(value_shape)}")


# Elements of one block of scores when a block holds whole rows (``softmax=True``): with the
# weights, their gradient and the mask's bits alive at once it stays well inside v4's 16 MiB VMEM.
_ROW_BLOCK_ELEMENTS = 2**17
# The most a block of whole rows may hold where a per-tile impl's tile rows set its least rows:
# GPT-2's 256 x 1024 scores, which compile for every generation.
_MAX_ROW_BLOCK_ELEMENTS = 2**18


def rows_fit(L: int, S: int, impl: str) -> bool:
    """Whether ``softmax=True`` takes ``(L, S)`` weights: 8 rows of ``S`` scores (and their
    tiles' padding) within :data:`_ROW_BLOCK_ELEMENTS`, and with a per-tile impl (hardware, tiled)
    the fewest rows a block of whole tiles holds within :data:`_MAX_ROW_BLOCK_ELEMENTS`."""
    if tiling.SUBLANES * tiling.round_up(S, 512) > _ROW_BLOCK_ELEMENTS:
        return False
    if not prng.per_tile(impl):
        return True
    return min(attention.attention_tile(L, S)[0], L) * tiling.round_up(S, 512) <= _MAX_ROW_BLOCK_ELEMENTS


def _row_blocks(L: int, S: int, impl: str) -> attention.AttentionBlocks:
    """Blocks of whole rows: as many rows as fit :data:`_ROW_BLOCK_ELEMENTS` (with a per-tile
    impl's bits drawn for whole tiles), a multiple of 8 and of its tile's rows, or all of ``L``."""
    tile = attention.attention_tile(L, S) if prng.per_tile(impl) else (tiling.SUBLANES, 1)
    rows = max(tile[0], _ROW_BLOCK_ELEMENTS // tiling.round_up(S, tile[1]) // tile[0] * tile[0])
    return attention.AttentionBlocks(min(rows, L), S)


def _checked_probability(p, impl, interpret, weights, value) -> float:
    p = arguments.check_probability(p)
    prng.check_can_run(impl, interpret)
    check_shapes(weights.shape, value.shape)
    return p


def _prepare(key_data, weights, value, p, impl, interpret, blocks, backward, softmax, global_shape, shard_offset):
    p = _checked_probability(p, impl, interpret, weights, value)
    *batch, L, S = weights.shape
    if softmax:
        if blocks is not None and blocks.kv < S:
            raise ValueError(f"blocks must hold whole rows (kv >= {S}) with softmax=True, got {blocks}")
        if not rows_fit(L, S, impl):
            per_tile = (f", and with impl={impl!r} at most {_MAX_ROW_BLOCK_ELEMENTS} in a block of the noise's "
                        f"{attention.attention_tile(L, S)[0]}-row tiles" if prng.per_tile(impl) else "")
            raise ValueError(f"softmax=True takes rows of at most {_ROW_BLOCK_ELEMENTS // tiling.SUBLANES} scores"
                             f"{per_tile} (whole rows per block, in VMEM), got weights of {L} x {S}")
        blocks = blocks or _row_blocks(L, S, impl)
    problem = attention.weights_problem(batch, L, S, value.shape[-1])
    static = attention.resolve_static(problem, blocks, dropout_p=p, impl=impl, causal=False, scale=1.0,
                                      interpret=interpret, backward=backward, global_shape=global_shape)
    L_padded = tiling.round_up(L, static.blocks.q)
    S_padded = static.S_padded
    # Padded weights and values are zeros: they add nothing to a product, and are sliced off.
    # (Scores are never padded along S: with softmax=True a block holds whole rows.)
    w = attention.padded(attention.padded(attention.flatten(weights), 1, L_padded), 2, S_padded)
    v = attention.planes_as_read(attention.padded(attention.flatten(value), 1, S_padded), static.value_transposed)
    return static, w, v, attention.noise_words(key_data, impl, shard_offset), L_padded, S_padded


# Per weight, for the kernels' cost estimates: a kept weight's scaling and ``x * 0`` (the select
# and the noise are counted with the dropout), and with softmax=True its shift, row maximum, sum
# and division (the backward kernels' softmax backward as many again).
_MASK_FLOPS = 2
_SOFTMAX_FLOPS = 4


def _kernel_name(static, softmax: bool, phase: str) -> str:
    return static.kernel_name("softmax_dropout_matmul" if softmax else "dropout_matmul", phase)


def _softmax(scores, dtype):
    """``softmax(scores, -1)`` of a block of whole rows, computed in float32 and rounded to
    ``dtype`` as torch's softmax of a ``dtype`` tensor; an all ``-inf`` row gives NaN, as torch's."""
    wide = scores.astype(jnp.float32)
    exponentials = jnp.exp(wide - jnp.max(wide, axis=1, keepdims=True))
    return (exponentials / jnp.sum(exponentials, axis=1, keepdims=True)).astype(dtype)


def _dropped(static, keep, w):
    """The block of weights ``w`` dropped where ``keep`` is False, in their dtype, as
    :func:`dropout.dropout` writes them."""
    return kept_values(keep, w, prng.keep_probability(static.impl, static.dropout_p)).astype(w.dtype)


def _weights_gradient(static, softmax, keep, w, grad_dropped):
    """The block's weights' gradient (with ``softmax`` the scores'), float32, from the dropped
    weights' ``grad_dropped`` (dropout's backward pass on it: the same mask), and the dropped
    weights, which the value's gradient multiplies."""
    grad_w = kept_values(keep, grad_dropped, prng.keep_probability(static.impl, static.dropout_p))
    if softmax:
        # The scores' gradient from the recomputed weights: softmax's backward over whole rows.
        w = _softmax(w, w.dtype)
        wide = w.astype(jnp.float32)
        grad_w = wide * (grad_w - jnp.sum(grad_w * wide, axis=1, keepdims=True))
    return grad_w, _dropped(static, keep, w)


def _kernel(body, static, softmax, inputs: int):
    """``body`` over the grid step's planes (:func:`attention.over_planes`): every operand but
    the key data is a block of them (the weights and the value share their batch dims)."""
    planes = static.blocks.planes > 1
    return attention.over_planes(functools.partial(body, static=static, softmax=softmax), static,
                                 [False] + [planes] * (inputs - 1))


def _forward_kernel(key_ref, w_ref, v_ref, out_ref, acc_ref, *, static, softmax, plane):
    b, q_index, kv_index = plane, pl.program_id(1), pl.program_id(2)

    @pl.when(kv_index == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    v = v_ref[...]
    w = w_ref[...]
    keep = attention.kept_weights(static, key_ref, b, q_index, kv_index)
    dropped = _dropped(static, keep, _softmax(w, w.dtype) if softmax else w)
    acc_ref[...] += attention.matmul(dropped.astype(v.dtype), v, static.value_transposed)

    @pl.when(kv_index == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def dropout_matmul_forward(key_data, weights, value, *, p: float, impl: str = prng.DROPOUT_DEFAULT, interpret: bool,
                           blocks: attention.AttentionBlocks | None = None, softmax: bool = False,
                           global_shape=None, shard_offset: jax.Array | None = None):
    """``dropout(weights, p) @ value`` in one kernel (see the module docstring).

    Args:
        key_data: int32 (2,) threefry key words.
        weights: ``(*batch, L, S)`` float32, bfloat16 or float16.
        value: ``(*batch, S, Ev)`` of the weights' dtype.
        p: drop probability in [0, 1].
        impl: ``"threefry"``, ``"tiled"`` or ``"hardware"`` (compiled on TPU only).
        interpret: run Pallas in interpret mode (any platform) or compiled (TPU).
        blocks: rows of L (``q``) and of S (``kv``) per grid step (default: the attention
            forward kernel's; with ``softmax`` whole rows), and where a block is a whole short
            plane, the planes a step takes (:class:`attention.AttentionBlocks` ``planes``).
        softmax: ``weights`` are scores: ``dropout(softmax(weights, -1)) @ value``.
        global_shape, shard_offset: the operands are a block of the batch dims
            ``global_shape[:-2]`` (a DTensor's local shard) whose first plane is at the flat
            batch index ``shard_offset`` there (int32 ``[high, low]`` words), with those
            planes' part of the mask.

    Returns:
        ``(*batch, L, Ev)`` in the weights' dtype.

    Raises:
        ValueError: ``p`` outside [0, 1], shapes :func:`check_shapes` rejects, or blocks
            :func:`attention.resolve_blocks` rejects.
    """
    if weights.dtype == jnp.float16:
        wide_weights, wide_value = tiling.widen_float16(weights, value)
        return dropout_matmul_forward(key_data, wide_weights, wide_value, p=p, impl=impl, interpret=interpret,
                                      blocks=blocks, softmax=softmax, global_shape=global_shape,
                                      shard_offset=shard_offset).astype(weights.dtype)
    if global_shape is None and heads_in_lanes.takes_weights(weights.shape, value.shape, weights.dtype, blocks=blocks):
        return _forward_in_lanes(key_data, weights, value, p=_checked_probability(p, impl, interpret, weights, value),
                                 impl=impl, interpret=interpret, softmax=softmax)
    static, w, v, words, L_padded, S_padded = _prepare(key_data, weights, value, p, impl, interpret, blocks, False,
                                                       softmax, global_shape, shard_offset)
    problem, blocks = static.problem, static.blocks
    grid = (static.grid_planes, L_padded // blocks.q, S_padded // blocks.kv)
    out_shape = jax.ShapeDtypeStruct((problem.size, L_padded, problem.Ev), weights.dtype)
    walk = attention.BlockWalk.of(static, *grid[1:], kv_major=False)
    out = calls.pallas_call(
        _kernel(_forward_kernel, static, softmax, inputs=3),
        name=_kernel_name(static, softmax, "fwd"),
        cost_estimate=walk.cost(
            bytes_accessed=walk.fetched(static.block_bytes(blocks.q, blocks.kv, w.dtype), "both")
            + walk.fetched(static.block_bytes(blocks.kv, problem.Ev, v.dtype), "inner")
            + calls.nbytes(words, out_shape),
            matmul_lanes=problem.Ev, elementwise=_MASK_FLOPS + (_SOFTMAX_FLOPS if softmax else 0),
            exponentials=softmax),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((static.plane_dim, blocks.q, blocks.kv), lambda b, i, j: (b, i, j)),
                  attention.plane_spec(static.plane_dim, blocks.kv, problem.Ev, static.value_transposed,
                                       lambda b, i, j: (b, j))],
        out_specs=pl.BlockSpec((static.plane_dim, blocks.q, problem.Ev), lambda b, i, j: (b, i, 0)),
        out_shape=out_shape,
        scratch_shapes=[static.scratch(blocks.q, problem.Ev)],
        compiler_params=attention.compiler_params(),
        interpret=interpret,
    )(words, w, v)
    return out[:, :problem.L].reshape(*problem.batch, problem.L, problem.Ev)


def _backward_kernel(key_ref, w_ref, v_ref, grad_out_ref, grad_w_ref, grad_v_ref, grad_v_acc, *, static, softmax,
                     plane):
    b, kv_index, q_index = plane, pl.program_id(1), pl.program_id(2)

    @pl.when(q_index == 0)
    def _():
        grad_v_acc[...] = jnp.zeros(grad_v_acc.shape, jnp.float32)

    grad_out = grad_out_ref[...]
    keep = attention.kept_weights(static, key_ref, b, q_index, kv_index)
    grad_w, dropped = _weights_gradient(static, softmax, keep, w_ref[...],
                                        attention.matmul(grad_out, v_ref[...], not static.value_transposed))
    grad_w_ref[...] = grad_w.astype(grad_w_ref.dtype)
    grad_v_acc[...] += jnp.dot(dropped.T.astype(grad_out.dtype), grad_out, preferred_element_type=jnp.float32)

    @pl.when(q_index == pl.num_programs(2) - 1)
    def _():
        grad_v_ref[...] = grad_v_acc[...].astype(grad_v_ref.dtype)


def dropout_matmul_backward(key_data, weights, value, grad_out, *, p: float, impl: str = prng.DROPOUT_DEFAULT,
                            interpret: bool, blocks: attention.AttentionBlocks | None = None, softmax: bool = False,
                            global_shape=None, shard_offset: jax.Array | None = None):
    """Gradients of :func:`dropout_matmul_forward` with respect to the weights and the value,
    given the same key, options (``global_shape`` and ``shard_offset`` too) and the output's
    gradient ``(*batch, L, Ev)``, in one kernel.
    ``blocks`` are its own (default: the attention backward kernels'; with ``softmax`` whole
    rows): the mask is regenerated. With ``softmax`` the first gradient is the scores'.

    Returns:
        ``(grad_weights (*batch, L, S), grad_value (*batch, S, Ev))`` in the operands' dtype.
    """
    if weights.dtype == jnp.float16:
        grads = dropout_matmul_backward(key_data, *tiling.widen_float16(weights, value, grad_out), p=p, impl=impl,
                                        interpret=interpret, blocks=blocks, softmax=softmax, global_shape=global_shape,
                                        shard_offset=shard_offset)
        return tuple(grad.astype(weights.dtype) for grad in grads)
    if global_shape is None and heads_in_lanes.takes_weights(weights.shape, value.shape, weights.dtype, blocks=blocks):
        return _backward_in_lanes(key_data, weights, value, grad_out.astype(weights.dtype),
                                  p=_checked_probability(p, impl, interpret, weights, value), impl=impl,
                                  interpret=interpret, softmax=softmax)
    static, w, v, words, L_padded, S_padded = _prepare(key_data, weights, value, p, impl, interpret, blocks, True,
                                                       softmax, global_shape, shard_offset)
    problem, blocks = static.problem, static.blocks
    grad_out = attention.padded(attention.flatten(grad_out.astype(weights.dtype)), 1, L_padded)
    # The value's gradient sums over the rows of L: they are the innermost axis, so each block of
    # it stays in VMEM until it is whole.
    grid = (static.grid_planes, S_padded // blocks.kv, L_padded // blocks.q)
    out_shape = [jax.ShapeDtypeStruct((problem.size, L_padded, S_padded), weights.dtype),
                 jax.ShapeDtypeStruct((problem.size, S_padded, problem.Ev), value.dtype)]
    walk = attention.BlockWalk.of(static, *grid[1:], kv_major=True)
    grad_w, grad_v = calls.pallas_call(
        _kernel(_backward_kernel, static, softmax, inputs=4),
        name=_kernel_name(static, softmax, "bwd"),
        cost_estimate=walk.cost(
            bytes_accessed=walk.fetched(static.block_bytes(blocks.q, blocks.kv, w.dtype), "both")
            + walk.fetched(static.block_bytes(blocks.kv, problem.Ev, v.dtype), "outer")
            + walk.fetched(static.block_bytes(blocks.q, problem.Ev, grad_out.dtype), "inner")
            + calls.nbytes(words, *out_shape),
            matmul_lanes=2 * problem.Ev, elementwise=2 * (_MASK_FLOPS + (_SOFTMAX_FLOPS if softmax else 0)),
            exponentials=softmax, dropout_selects=2),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((static.plane_dim, blocks.q, blocks.kv), lambda b, j, i: (b, i, j)),
                  attention.plane_spec(static.plane_dim, blocks.kv, problem.Ev, static.value_transposed,
                                       lambda b, j, i: (b, j)),
                  pl.BlockSpec((static.plane_dim, blocks.q, problem.Ev), lambda b, j, i: (b, i, 0))],
        out_specs=[pl.BlockSpec((static.plane_dim, blocks.q, blocks.kv), lambda b, j, i: (b, i, j)),
                   pl.BlockSpec((static.plane_dim, blocks.kv, problem.Ev), lambda b, j, i: (b, j, 0))],
        out_shape=out_shape,
        scratch_shapes=[static.scratch(blocks.kv, problem.Ev)],
        compiler_params=attention.compiler_params(),
        interpret=interpret,
    )(words, w, v, grad_out)
    grad_w = grad_w[:, :problem.L, :problem.S].reshape(weights.shape)
    grad_v = grad_v[:, :problem.S].reshape(value.shape)
    return grad_w, grad_v


def _dropout_weights_kernel(key_ref, w_ref, out_ref, *, static, plane):
    keep = attention.kept_weights(static, key_ref, plane, pl.program_id(1), pl.program_id(2))
    out_ref[...] = _dropped(static, keep, w_ref[...])


def dropout_weights(key_data, weights, *, p: float, impl: str = prng.DROPOUT_DEFAULT, interpret: bool,
                    blocks: attention.AttentionBlocks | None = None, global_shape=None,
                    shard_offset: jax.Array | None = None):
    """``dropout(weights, p)`` of ``(*batch, L, S)`` attention weights with the mask this
    module's kernels (and :mod:`attention`'s) draw for them (:func:`attention.kept_weights`):
    the dropped weights :func:`dropout_matmul_forward` multiplies by the value, as an array. With
    the per-tile impls that is not :func:`dropout.dropout`'s mask for the same key (drawn per
    tile of a 2-D view of the whole tensor); with ``"threefry"`` it is. Dropout is linear: its
    backward pass is this function on the gradient.

    Args:
        key_data, p, impl, interpret, global_shape, shard_offset: as
            :func:`dropout_matmul_forward` takes them.
        weights: ``(*batch, L, S)`` float32, bfloat16 or float16.
        blocks: rows of L and of S per grid step (default: the attention forward kernel's).

    Returns:
        The dropped weights, ``weights``' shape and dtype.

    Raises:
        ValueError: ``p`` outside [0, 1], weights of fewer than two dims, or blocks
            :func:`attention.resolve_blocks` rejects.
    """
    if weights.dtype == jnp.float16:
        return dropout_weights(key_data, weights.astype(jnp.float32), p=p, impl=impl, interpret=interpret,
                               blocks=blocks, global_shape=global_shape, shard_offset=shard_offset).astype(weights.dtype)
    p = arguments.check_probability(p)
    prng.check_can_run(impl, interpret)
    if weights.ndim < 2:
        raise ValueError(f"weights must be (*batch, L, S), got shape {tuple(weights.shape)}")
    *batch, L, S = weights.shape
    static = attention.resolve_static(attention.weights_problem(batch, L, S, 0), blocks, dropout_p=p, impl=impl,
                                      causal=False, scale=1.0, interpret=interpret, backward=False,
                                      global_shape=global_shape)
    problem, blocks = static.problem, static.blocks
    L_padded, S_padded = tiling.round_up(L, blocks.q), static.S_padded
    w = attention.padded(attention.padded(attention.flatten(weights), 1, L_padded), 2, S_padded)
    words = attention.noise_words(key_data, impl, shard_offset)
    grid = (static.grid_planes, L_padded // blocks.q, S_padded // blocks.kv)
    walk = attention.BlockWalk.of(static, *grid[1:], kv_major=False)
    spec = pl.BlockSpec((static.plane_dim, blocks.q, blocks.kv), lambda b, i, j: (b, i, j))
    out = calls.pallas_call(
        attention.over_planes(functools.partial(_dropout_weights_kernel, static=static), static,
                              [False, blocks.planes > 1]),
        name=static.kernel_name("dropout_weights", ""),
        cost_estimate=walk.cost(bytes_accessed=2 * calls.nbytes(w) + calls.nbytes(words), matmul_lanes=0,
                                elementwise=_MASK_FLOPS, exponentials=False),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
    )(words, w)
    return out[:, :L, :S].reshape(weights.shape)


# Eager attention's weights over short planes, ``(B, H, L, S)``, with a value that a model's
# projection holds as ``(B, S, H * E)``: the kernels read the value, the output and its gradient
# in that layout (:mod:`heads_in_lanes`), which XLA would otherwise copy into planes and back.


def _lanes_plan(weights, value, p, impl, interpret) -> heads_in_lanes.Plan:
    B, H, L, S = weights.shape
    return heads_in_lanes.Plan((B, H, L, value.shape[-1]), value.shape, dropout_p=p, impl=impl, interpret=interpret,
                               weights_dtype=weights.dtype)


def _lanes_cost(plan, softmax, bytes_accessed, matmuls):
    """The cost of ``matmuls`` products over whole 128-lane columns per weight (forward 1,
    backward 2), the mask's and the softmax's work as many times, and one exponential per weight
    with the softmax (the backward recomputes it)."""
    weights = plan.B * plan.H * plan.L * plan.S
    return calls.cost_estimate(bytes_accessed=bytes_accessed,
                               flops=weights * matmuls * (2 * tiling.LANES + _MASK_FLOPS
                                                          + (_SOFTMAX_FLOPS if softmax else 0)),
                               transcendentals=weights if softmax else 0)


def _forward_in_lanes_kernel(key_ref, w_ref, v_ref, out_ref, *, plan, softmax):
    masks = plan.lane_masks(plan.L)
    per_head = []
    for lanes, within, local, head in plan.heads():
        w = w_ref[local]
        dropped = _dropped(plan.static, plan.kept(key_ref, head), _softmax(w, w.dtype) if softmax else w)
        v = v_ref[:, lanes]
        # The whole column times the head's weights: its own lanes are kept.
        per_head.append(jnp.dot(dropped.astype(v.dtype), v, preferred_element_type=jnp.float32))
        if within == plan.heads_per_column - 1:
            out_ref[:, lanes] = heads_in_lanes.select_lanes(masks, per_head).astype(out_ref.dtype)
            per_head = []


def _forward_in_lanes(key_data, weights, value, *, p, impl, interpret, softmax):
    plan = _lanes_plan(weights, value, p, impl, interpret)
    v = heads_in_lanes.heads_in_lanes(value)
    words = attention.noise_words(key_data, impl, None)
    out_shape = jax.ShapeDtypeStruct((plan.B, plan.L, v.shape[-1]), weights.dtype)
    out = calls.pallas_call(
        functools.partial(_forward_in_lanes_kernel, plan=plan, softmax=softmax),
        name=plan.kernel_name("fwd", "softmax_dropout_matmul" if softmax else "dropout_matmul"),
        cost_estimate=_lanes_cost(plan, softmax, calls.nbytes(words, weights, v, out_shape), matmuls=1),
        grid=plan.grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), plan.weights_spec(), plan.spec(plan.S)],
        out_specs=plan.spec(plan.L),
        out_shape=out_shape,
        compiler_params=plan.compiler_params(),
        interpret=interpret,
    )(words, weights, v)
    return heads_in_lanes.heads_apart(out, plan.H)


def _backward_in_lanes_kernel(key_ref, w_ref, v_ref, grad_out_ref, grad_w_ref, grad_v_ref, *, plan, softmax):
    row_masks, key_masks = plan.lane_masks(plan.L), plan.lane_masks(plan.S)
    per_head = []
    for lanes, within, local, head in plan.heads():
        grad_out = grad_out_ref[:, lanes]
        keep = plan.kept(key_ref, head)
        # The head's lanes of the gradient against the whole column of values: its own products.
        mine = jnp.where(row_masks[within], grad_out, jnp.zeros((), grad_out.dtype))
        grad_dropped = lax.dot_general(mine, v_ref[:, lanes], (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
        grad_w, dropped = _weights_gradient(plan.static, softmax, keep, w_ref[local], grad_dropped)
        grad_w_ref[local] = grad_w.astype(grad_w_ref.dtype)
        per_head.append(jnp.dot(dropped.T.astype(grad_out.dtype), grad_out, preferred_element_type=jnp.float32))
        if within == plan.heads_per_column - 1:
            grad_v_ref[:, lanes] = heads_in_lanes.select_lanes(key_masks, per_head).astype(grad_v_ref.dtype)
            per_head = []


def _backward_in_lanes(key_data, weights, value, grad_out, *, p, impl, interpret, softmax):
    plan = _lanes_plan(weights, value, p, impl, interpret)
    v, g = heads_in_lanes.heads_in_lanes(value), heads_in_lanes.heads_in_lanes(grad_out)
    words = attention.noise_words(key_data, impl, None)
    out_shape = [jax.ShapeDtypeStruct(weights.shape, weights.dtype), jax.ShapeDtypeStruct(v.shape, value.dtype)]
    grad_w, grad_v = calls.pallas_call(
        functools.partial(_backward_in_lanes_kernel, plan=plan, softmax=softmax),
        name=plan.kernel_name("bwd", "softmax_dropout_matmul" if softmax else "dropout_matmul"),
        cost_estimate=_lanes_cost(plan, softmax, calls.nbytes(words, weights, v, g, *out_shape), matmuls=2),
        grid=plan.grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), plan.weights_spec(), plan.spec(plan.S), plan.spec(plan.L)],
        out_specs=[plan.weights_spec(), plan.spec(plan.S)],
        out_shape=out_shape,
        compiler_params=plan.compiler_params(),
        interpret=interpret,
    )(words, weights, v, g)
    return grad_w, heads_in_lanes.heads_apart(grad_v, plan.H)
