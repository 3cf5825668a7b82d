"""Attention over short planes on operands laid out as a transformers model's projections hold
them, ``(B, L, H * E)``: several heads in each 128-lane column. :func:`attention.attention_forward`
and :func:`attention.attention_backward` run these kernels where :func:`takes` says so.

The flash kernels read ``(B * H, L, E)`` planes, so XLA copies the projections' ``(B, L, H * E)``
output into that layout for every query, key, value and incoming gradient, and the gradients
back; with ``E = 64`` a plane is also padded to 128 lanes. Over 128 tokens those copies cost
more than the attention (BERT at 8 x 128 tokens, float32: ``bench/results/tpu_short_attention.md``);
over ViT-B/16's 197 patches, whose activations XLA lays out with the batch dim tiled, they were
most of the copies in its training step (``bench/results/tpu_step.md``).
These kernels take each operand as ``(B, L, H * E)`` (``swapaxes`` and ``reshape`` of the
``(B, H, L, E)`` arguments, which XLA cancels against the model's own transposes) in blocks of
whole 128-lane columns: a column holds ``128 / E`` heads; a head's matrix products read the
whole column with the other heads' lanes zeroed (the matrix unit's depth is 128 lanes either
way), and its results are selected back into its lanes. Scores, mask and softmax are the
flash kernels' whole-rows ones (the same mask bits, plane ``b * H + h``, for every impl), so a
call gives what the flash kernels give, to rounding.

:mod:`dropout_matmul` runs eager attention's weights times their value on this layout too
(:func:`takes_weights`, :class:`Plan` with ``weights_dtype``).
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import attention, calls, tiling

# Lengths up to this take one block of rows and one of keys (a step's planes whole).
MAX_LENGTH = 256
# A grid step's block of each operand, at most: columns are grouped up to it (VMEM holds the
# forward's four and the backward's eight, each double-buffered). ViT-B/16's 12 heads of 197 rows,
# which the row statistics' blocks need in one step (6 of 8 heads would not be whole sublanes),
# take 591 KiB.
_MAX_BLOCK_BYTES = 640 * 1024


def takes(query_shape, key_shape, value_shape, *, bias, gqa: bool, blocks, global_shape, causal: bool,
          bias_grad: bool = False) -> bool:
    """Whether a call runs as these kernels: ``(B, H, L, E)`` query, key and value of the same batch
    dims, no GQA, the default blocks, not a shard; a mask, if any, the same for every head (a
    padding or causal mask: :func:`_bias_shape`) and without its gradient (``bias_grad``); a head
    dim that divides 128 lanes and whole columns of heads; ``L`` and ``S`` at most
    :data:`MAX_LENGTH` (a step reads them whole, so they need not be whole tiles); causal only with
    ``L == S``."""
    if gqa or blocks is not None or global_shape is not None or bias_grad or len(query_shape) != 4:
        return False
    B, H, L, E = query_shape
    if tuple(key_shape[:2]) != (B, H) or tuple(value_shape[:2]) != (B, H):
        return False
    S, Ev = key_shape[2], value_shape[3]
    if bias is not None and _bias_shape(bias.shape, B, L, S) is None:
        return False
    return E == Ev and (not causal or L == S) and _fits(H, L, S, E, weights_dtype=None)


def takes_weights(weights_shape, value_shape, dtype, *, blocks) -> bool:
    """Whether :func:`torch_pallas.kernels.dropout_matmul.dropout_matmul_forward` (and its
    backward) of ``(B, H, L, S)`` weights of ``dtype`` and a ``(B, H, S, E)`` value runs as this
    module's kernels: the default blocks, and the lengths and head dim :func:`takes` accepts."""
    if blocks is not None or len(weights_shape) != 4 or len(value_shape) != 4:
        return False
    B, H, L, S = weights_shape
    return tuple(value_shape[:3]) == (B, H, S) and _fits(H, L, S, value_shape[3], weights_dtype=dtype)


def _fits(H: int, L: int, S: int, E: int, *, weights_dtype) -> bool:
    """A head dim dividing 128 lanes and whole columns of heads, ``L`` and ``S`` at most
    :data:`MAX_LENGTH`, and a grid step's blocks that fit VMEM."""
    return (tiling.LANES % E == 0 and (H * E) % tiling.LANES == 0 and L <= MAX_LENGTH and S <= MAX_LENGTH
            and _columns_per_step(L, S, H * E // tiling.LANES, tiling.LANES // E, weights_dtype) is not None)


def _bias_shape(shape, B: int, L: int, S: int):
    """A mask's ``(batch, rows, S)``, its batch 1 or ``B`` and rows 1 or ``L``, where it is the same
    for every head and has a column per key; else None."""
    if len(shape) > 4:
        return None
    batch, heads, rows, cols = (1,) * (4 - len(shape)) + tuple(shape)
    if heads != 1 or cols != S or batch not in (1, B) or rows not in (1, L):
        return None
    return batch, rows, cols


def heads_in_lanes(array):
    """``(B, H, L, E)`` as ``(B, L, H * E)``."""
    B, H, L, E = array.shape
    return jnp.swapaxes(array, 1, 2).reshape(B, L, H * E)


def heads_apart(array, heads: int):
    """``(B, L, H * E)`` as ``(B, H, L, E)``."""
    B, L, width = array.shape
    return jnp.swapaxes(array.reshape(B, L, heads, width // heads), 1, 2)


def _columns_per_step(L: int, S: int, columns: int, heads_per_column: int, weights_dtype) -> int | None:
    """The most columns per grid step, dividing the columns, whose float32 block fits
    :data:`_MAX_BLOCK_BYTES`; for attention (no ``weights_dtype``) with whole 8-row blocks of the
    row statistics' heads (or every head), for weights given their heads' ``(L, S)`` planes within
    twice that; None if none."""
    def fits(g):
        if weights_dtype is None:
            heads_fit = g == columns or g * heads_per_column % tiling.SUBLANES == 0
        else:
            heads_fit = g * heads_per_column * L * S * jnp.dtype(weights_dtype).itemsize <= 2 * _MAX_BLOCK_BYTES
        return columns % g == 0 and heads_fit and max(L, S) * g * tiling.LANES * 4 <= _MAX_BLOCK_BYTES

    return max(filter(fits, range(1, columns + 1)), default=None)


class Plan:
    """One call's shapes: heads, lengths, the mask's, columns per grid step, and the flash kernels'
    static configuration for whole planes (:func:`attention.kept_weights` draws the mask from it).
    With ``weights_dtype`` the call is a product of given ``(B, H, L, S)`` weights of that dtype
    (``query_shape`` then the output's, ``key_shape`` the value's), which a step reads whole."""

    def __init__(self, query_shape, key_shape, bias=None, *, dropout_p, impl, causal=False, scale=1.0, interpret,
                 weights_dtype=None):
        self.B, self.H, self.L, self.E = query_shape
        self.S = key_shape[2]
        self.bias_shape = None if bias is None else _bias_shape(bias.shape, self.B, self.L, self.S)
        problem = attention.resolve_problem(query_shape, key_shape, key_shape)
        self.static = attention.resolve_static(problem, attention.AttentionBlocks(self.L, self.S, 1),
                                               dropout_p=dropout_p, impl=impl, causal=causal, scale=scale,
                                               interpret=interpret, backward=False, global_shape=None)
        self.heads_per_column = tiling.LANES // self.E
        columns = self.H * self.E // tiling.LANES
        self.columns_per_step = _columns_per_step(self.L, self.S, columns, self.heads_per_column, weights_dtype)
        self.grid = (self.B, columns // self.columns_per_step)
        self.heads_per_step = self.columns_per_step * self.heads_per_column

    def spec(self, rows):
        return pl.BlockSpec((None, rows, self.columns_per_step * tiling.LANES), lambda b, g: (b, 0, g))

    def bias(self, bias, dtype):
        """The mask as the kernels read it, ``(batch, rows, S)``: :func:`attention.additive_mask`."""
        return attention.additive_mask(bias, dtype).reshape(self.bias_shape)

    def bias_spec(self):
        batch, rows, cols = self.bias_shape
        return pl.BlockSpec((None, rows, cols), lambda b, g: (b if batch > 1 else 0, 0, 0))

    def row_stat_spec(self):
        return pl.BlockSpec((None, self.heads_per_step, self.L), lambda b, g: (b, g, 0))

    def weights_spec(self):
        """The step's heads' whole ``(L, S)`` planes of ``(B, H, L, S)`` weights."""
        return pl.BlockSpec((None, self.heads_per_step, self.L, self.S), lambda b, g: (b, g, 0, 0))

    def kernel_name(self, phase, kernel="attention"):
        static = self.static
        return calls.kernel_name(kernel, phase, static.impl if static.dropout_p else "",
                                 "causal" if static.causal else "", "lanes", blocks=(self.L, self.S))

    def cost(self, bytes_accessed, matmuls):
        scores = self.B * self.H * self.L * self.S
        return calls.cost_estimate(bytes_accessed=bytes_accessed,
                                   flops=scores * 2 * tiling.LANES * matmuls, transcendentals=scores)

    def heads(self):
        """Each head of the step: (its column's lanes in the step's block, a slice; its place in
        the column; its place in the step; its index in the batch element, a traced int)."""
        for column in range(self.columns_per_step):
            lanes = slice(column * tiling.LANES, (column + 1) * tiling.LANES)
            for within in range(self.heads_per_column):
                local = column * self.heads_per_column + within
                yield lanes, within, local, pl.program_id(1) * self.heads_per_step + local

    def compiler_params(self):
        """Every grid step is independent: batch elements and groups of columns."""
        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))

    def lane_masks(self, rows):
        lane = lax.broadcasted_iota(jnp.int32, (rows, tiling.LANES), 1) // self.E
        return [lane == within for within in range(self.heads_per_column)]

    def scores(self, q_head, k_column, bias_ref):
        """The head's scaled scores, float32 ``(L, S)``: its query lanes (others zeroed) against
        the key's whole column, plus the mask; ``-inf`` above the diagonal where causal."""
        s = lax.dot_general(q_head, k_column, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * np.float32(self.static.scale)
        if bias_ref is not None:
            s = s + bias_ref[...].astype(jnp.float32)
        if self.static.causal:
            rows = lax.broadcasted_iota(jnp.int32, s.shape, 0)
            cols = lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(cols <= rows, s, -jnp.inf)
        return s

    def kept(self, key_ref, head):
        plane = pl.program_id(0) * self.H + head
        return attention.kept_weights(self.static, key_ref, plane, 0, 0)


def select_lanes(masks, per_head):
    """One column from each head's full-width result: head ``j``'s lanes from ``per_head[j]``."""
    column = per_head[-1]
    for mask, result in zip(masks[:-1], per_head[:-1]):
        column = jnp.where(mask, result, column)
    return column


def _forward_kernel(key_ref, q_ref, k_ref, v_ref, *refs, plan: Plan):
    bias_ref, out_ref, lse_ref = refs if plan.bias_shape else (None, *refs)
    masks = plan.lane_masks(plan.L)
    per_head = []
    for lanes, within, local, head in plan.heads():
        q_head = jnp.where(masks[within], q_ref[:, lanes], jnp.zeros((), q_ref.dtype))
        s = plan.scores(q_head, k_ref[:, lanes], bias_ref)
        p, inverse, lse = attention.whole_rows_softmax(plan.static, s, lambda: plan.kept(key_ref, head))
        v = v_ref[:, lanes]
        per_head.append(jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32) * inverse)
        lse_ref[local:local + 1, :] = attention.row_stat_row(lse)
        if within == plan.heads_per_column - 1:
            out_ref[:, lanes] = select_lanes(masks, per_head).astype(out_ref.dtype)
            per_head = []


def forward(key_data, query, key, value, bias=None, *, dropout_p, impl, causal, scale, interpret, result_dtype):
    """:func:`attention.attention_forward`'s output (of ``result_dtype``) and log-sum-exp for a call
    :func:`takes`."""
    plan = Plan(query.shape, key.shape, bias, dropout_p=dropout_p, impl=impl, causal=causal, scale=scale,
                interpret=interpret)
    q, k, v = heads_in_lanes(query), heads_in_lanes(key), heads_in_lanes(value)
    masks = [] if bias is None else [plan.bias(bias, query.dtype)]
    words = attention.noise_words(key_data, impl, None)
    out_shape = [jax.ShapeDtypeStruct(q.shape, result_dtype),
                 jax.ShapeDtypeStruct((plan.B, plan.H, plan.L), jnp.float32)]
    out, lse = calls.pallas_call(
        functools.partial(_forward_kernel, plan=plan),
        name=plan.kernel_name("fwd"),
        cost_estimate=plan.cost(calls.nbytes(words, q, k, v, *masks, *out_shape), matmuls=2),
        grid=plan.grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), plan.spec(plan.L), plan.spec(plan.S), plan.spec(plan.S),
                  *([plan.bias_spec()] if masks else [])],
        out_specs=[plan.spec(plan.L), plan.row_stat_spec()],
        out_shape=out_shape,
        compiler_params=plan.compiler_params(),
        interpret=interpret,
    )(words, q, k, v, *masks)
    return heads_apart(out, plan.H), lse


def _backward_kernel(key_ref, q_ref, k_ref, v_ref, *refs, plan: Plan):
    bias_ref, refs = (refs[0], refs[1:]) if plan.bias_shape else (None, refs)
    out_ref, grad_out_ref, lse_ref, grad_q_ref, grad_k_ref, grad_v_ref = refs
    static = plan.static
    query_masks, key_masks = plan.lane_masks(plan.L), plan.lane_masks(plan.S)
    scale = np.float32(static.scale)
    per_head = {"q": [], "k": [], "v": []}
    for lanes, within, local, head in plan.heads():
        q, k, v = q_ref[:, lanes], k_ref[:, lanes], v_ref[:, lanes]
        grad_out = grad_out_ref[:, lanes]
        mine = query_masks[within]
        zero = jnp.zeros((), q.dtype)
        s = plan.scores(jnp.where(mine, q, zero), k, bias_ref)
        # lse is inf for rows that attend to nothing: their weights are 0.
        p = jnp.exp(s - jnp.expand_dims(lse_ref[local], -1))
        # rowsum(dO * O), the softmax's gradient term, from the head's lanes.
        delta = jnp.sum(jnp.where(mine, grad_out.astype(jnp.float32) * out_ref[:, lanes].astype(jnp.float32),
                                  np.float32(0.0)), axis=1, keepdims=True)
        if static.dropout_p:
            # The kept weights' 1 / (1 - p) on the gradient: a dropped weight is then a select.
            grad_out = (grad_out.astype(jnp.float32)
                        * attention.kept_scale(static.impl, static.dropout_p)).astype(grad_out.dtype)
        grad_p = lax.dot_general(jnp.where(mine, grad_out.astype(v.dtype), zero), v, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        dropped = p
        if static.dropout_p:
            kept = plan.kept(key_ref, head)
            dropped = jnp.where(kept, p, np.float32(0.0))
            grad_p = jnp.where(kept, grad_p, np.float32(0.0))
        per_head["v"].append(lax.dot_general(dropped.astype(grad_out.dtype), grad_out, (((0,), (0,)), ((), ())),
                                             preferred_element_type=jnp.float32))
        grad_s = p * (grad_p - delta)
        per_head["k"].append(lax.dot_general(grad_s.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                             preferred_element_type=jnp.float32) * scale)
        per_head["q"].append(jnp.dot(grad_s.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale)
        if within == plan.heads_per_column - 1:
            for name, ref, masks in (("q", grad_q_ref, query_masks), ("k", grad_k_ref, key_masks),
                                     ("v", grad_v_ref, key_masks)):
                ref[:, lanes] = select_lanes(masks, per_head[name]).astype(ref.dtype)
                per_head[name] = []


def backward(key_data, query, key, value, out, lse, grad_out, bias=None, *, dropout_p, impl, causal, scale,
             interpret):
    """:func:`attention.attention_backward`'s query, key and value gradients (in ``grad_out``'s dtype)
    for a call :func:`takes` (a mask gets none)."""
    plan = Plan(query.shape, key.shape, bias, dropout_p=dropout_p, impl=impl, causal=causal, scale=scale,
                interpret=interpret)
    masks = [] if bias is None else [plan.bias(bias, query.dtype)]
    q, k, v = (heads_in_lanes(x.astype(query.dtype)) for x in (query, key, value))
    o, g = (heads_in_lanes(x.astype(grad_out.dtype)) for x in (out, grad_out))
    words = attention.noise_words(key_data, impl, None)
    lse = lse.astype(jnp.float32)
    out_shape = [jax.ShapeDtypeStruct(x.shape, grad_out.dtype) for x in (q, k, v)]
    grad_q, grad_k, grad_v = calls.pallas_call(
        functools.partial(_backward_kernel, plan=plan),
        name=plan.kernel_name("dqkv"),
        cost_estimate=plan.cost(calls.nbytes(words, q, k, v, *masks, o, g, lse, *out_shape), matmuls=5),
        grid=plan.grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), plan.spec(plan.L), plan.spec(plan.S), plan.spec(plan.S),
                  *([plan.bias_spec()] if masks else []), plan.spec(plan.L), plan.spec(plan.L), plan.row_stat_spec()],
        out_specs=[plan.spec(plan.L), plan.spec(plan.S), plan.spec(plan.S)],
        out_shape=out_shape,
        compiler_params=plan.compiler_params(),
        interpret=interpret,
    )(words, q, k, v, *masks, o, g, lse)
    return heads_apart(grad_q, plan.H), heads_apart(grad_k, plan.H), heads_apart(grad_v, plan.H)
