"""``torch_pallas::attention`` and its backward: flash attention with dropout as
differentiable ops. The forward saves query, key, value, its output, the float32 row
log-sum-exp and the 8-byte key; the backward kernels recompute the probabilities and
regenerate the mask. Where the kernels are compiled for a TPU, float32 query, key and value
reach them rounded to bfloat16 (:func:`bfloat16_operands`) and are saved so.

:func:`apply` is the differentiable entry point (autograd, ``torch.func``'s reverse-mode
transforms, ``torch.compile``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch_pallas import bridge, sharding
from torch_pallas.ops import _autograd
from torch_pallas.kernels import attention as attention_kernels
from torch_pallas.sharding import Sharding


def _blocks(blocks):
    return None if blocks is None else attention_kernels.AttentionBlocks(*blocks)


def _mask_operand(attn_mask):
    return () if attn_mask is None else (attn_mask,)


def shard_dims(sharding: Sharding, query, key, value, attn_mask, mask_grad: bool = False):
    """How the operands follow ``sharding``, query's, for a run per shard: (the dims of query's
    batch, which query, key, value and the outputs follow; the mask's dims or ``None``), as
    :func:`torch_pallas.bridge.call_sharded` takes them. Query's batch dims may be split (key and value split
    with them: GQA heads too); its length and head dims may not.

    Raises:
        ValueError: a split length or head dim, key or value broadcast along a split dim
            (their gradients would be partial sums), uneven shards, or a float mask with a
            gradient broadcast along a split dim.
    """
    rank = query.dim()
    sharding.shard_shape(query.shape, "query")
    tiles = sharding.tiles
    if tiles[-2] > 1 or tiles[-1] > 1:
        raise ValueError(f"query is split along its length or head dim ({sharding.text}); scaled_dot_product_attention "
                         "runs per shard when only batch dims (batch, heads) are split")
    batch_dims = tuple(range(rank - 2))
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != rank or any(tiles[d] > 1 and tensor.shape[d] == 1 for d in batch_dims):
            raise ValueError(f"{name} of shape {tuple(tensor.shape)} is broadcast along a dim that query's sharding "
                             f"{sharding.text} splits; give it query's batch dims")
        sharding.shard_shape(tuple(tensor.shape[:-2]) + (1, 1), name)
    mask = None
    if attn_mask is not None:
        # The mask's dims line up with query's from the right; it has at most query's rank.
        lead = rank - attn_mask.dim()
        mask = tuple(None if d + lead >= rank - 2 or attn_mask.shape[d] == 1 else d + lead
                     for d in range(attn_mask.dim()))
        if mask_grad and any(tiles[d + lead] > 1 and mask[d] is None for d in range(attn_mask.dim() - 2)):
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} requires a gradient and is broadcast "
                             f"along a dim that query's sharding {sharding.text} splits")
    return batch_dims, mask


def bfloat16_operands(query: torch.Tensor) -> bool:
    """Whether attention on ``query`` gives the kernels its float32 query, key and value
    rounded to bfloat16, with float32 results: where the kernels are compiled for a TPU
    (:func:`torch_pallas.bridge.compiles_for_tpu`). Their matrix products round float32
    operands to bfloat16 there anyway (Mosaic's default precision, one pass of the matrix unit:
    :mod:`torch_pallas.kernels.attention`), as XLA's do at torch_xla's default precision, so
    the rounding costs no accuracy, and the backward pass keeps half the bytes: torch's own
    attention on a TPU keeps bfloat16 copies of them too. In interpret mode the products are
    float32 and the operands stay float32."""
    return query.dtype == torch.float32 and bridge.compiles_for_tpu(query)


def _call(kernel, sharding_text, key_data, query, key, value, extra, attn_mask, output_ranks, global_batch=None,
          global_offset=0, **static):
    """``kernel(key_data, query, key, value, *extra, attn_mask, **static)`` on the whole tensors,
    or with ``sharding_text`` per shard of query's sharding, each shard with the noise of its
    batch dims' place: every tensor but the key data and the mask follows query's batch dims,
    and so do the outputs (of ``output_ranks`` dims), then the mask's gradient (``bias_grad``).
    With ``global_batch``, the tensors are a block of the batch dims ``global_batch`` whose first
    plane is at flat index ``global_offset`` there (a DTensor's local shard), with that block's
    noise."""
    tensors = [key_data, query, key, value, *extra, *_mask_operand(attn_mask)]
    if global_batch is not None:
        return sharding.call_on_block(kernel, *tensors, global_shape=(*global_batch, 1, 1),
                                      global_offset=global_offset, **static)
    if sharding_text is None:
        return bridge.call(kernel, *tensors, **static)
    batch_dims, mask_dims = shard_dims(Sharding.parse(sharding_text), query, key, value, attn_mask)

    def following(rank):
        return (*batch_dims, *(None,) * (rank - len(batch_dims)))

    in_dims = [(None,), *(following(tensor.dim()) for tensor in (query, key, value, *extra)),
               *(() if attn_mask is None else (mask_dims,))]
    out_dims = [following(rank) for rank in output_ranks] + ([mask_dims] if static.get("bias_grad") else [])
    return bridge.call_sharded(kernel, sharding_text, tensors, in_dims, out_dims,
                               noise_shape=(*query.shape[:-2], 1, 1), **static)


def _compute_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
               key_data: torch.Tensor, dropout_p: float, impl: str, is_causal: bool, scale: float, enable_gqa: bool,
               blocks: Optional[Sequence[int]], backward_blocks: Optional[Sequence[int]],
                       rounded: bool = False, sharding_text: Optional[str] = None,
                       global_batch: Optional[Sequence[int]] = None, global_offset: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, float32 row log-sum-exp ``(*batch, L)``, the query, key and value the backward
    pass reads) of :func:`torch_pallas.scaled_dot_product_attention`; arguments pre-checked,
    shapes not empty. ``blocks`` / ``backward_blocks``: (q, kv) rows per block of the forward
    and the backward kernels, or ``None`` for the default; the mask depends on neither.
    ``rounded`` (:func:`bfloat16_operands`): float32 query, key and value go to the kernels as
    bfloat16, returned as the last three outputs, and the output is float32; without it those
    outputs are empty (an op returns no input: the inputs themselves are saved).
    ``sharding_text``: the text of query's :class:`~torch_pallas.sharding.Sharding` over batch
    dims; each device runs its shard, with its part of the unsharded mask (:func:`shard_dims`).
    ``global_batch``, ``global_offset``: the operands are a block of those batch dims (:func:`_call`)."""
    operands = (query, key, value)
    if rounded:
        operands = tuple(operand.to(torch.bfloat16) for operand in operands)
    out, lse = _call(attention_kernels.attention_forward, sharding_text, key_data, *operands, (), attn_mask,
                     (query.dim(), query.dim() - 1), global_batch, global_offset, dropout_p=dropout_p, impl=impl, causal=is_causal, scale=scale,
                     gqa=enable_gqa, blocks=_blocks(blocks), result_dtype="float32" if rounded else None)
    saved = operands if rounded else tuple(query.new_empty(0) for _ in operands)
    return out, lse, *saved


def output_shapes(query, key, value, attn_mask, enable_gqa):
    """The output's and the log-sum-exp's shapes (:func:`attention_kernels.resolve_problem`)."""
    problem = attention_kernels.resolve_problem(query.shape, key.shape, value.shape,
                                                None if attn_mask is None else attn_mask.shape, gqa=enable_gqa)
    return (*problem.batch, problem.L, problem.Ev), (*problem.batch, problem.L)


attention = torch.library.custom_op("torch_pallas::attention", _compute_attention, mutates_args=())


@attention.register_fake
def _(query, key, value, attn_mask, key_data, dropout_p, impl, is_causal, scale, enable_gqa, blocks, backward_blocks,
      rounded=False, sharding_text=None, global_batch=None, global_offset=0):
    out_shape, lse_shape = output_shapes(query, key, value, attn_mask, enable_gqa)
    saved = ((operand.new_empty(operand.shape, dtype=torch.bfloat16) if rounded else query.new_empty(0))
             for operand in (query, key, value))
    return query.new_empty(out_shape), query.new_empty(lse_shape, dtype=torch.float32), *saved


def _compute_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
                        key_data: torch.Tensor, dropout_p: float, impl: str, is_causal: bool, scale: float,
                        enable_gqa: bool, blocks: Optional[Sequence[int]], mask_grad: bool,
                                sharding_text: Optional[str] = None, global_batch: Optional[Sequence[int]] = None,
                                global_offset: int = 0) -> list[torch.Tensor]:
    """Gradients of :func:`attention` for query, key and value (of ``grad_out``'s dtype: float32
    for the bfloat16 ones a rounded forward saved), and with ``mask_grad`` for a float
    ``attn_mask`` (summed to its shape), from the forward's output and log-sum-exp."""
    return list(_call(attention_kernels.attention_backward, sharding_text, key_data, query, key, value,
                      (out, lse, grad_out), attn_mask, (query.dim(),) * 3, global_batch, global_offset,
                      dropout_p=dropout_p, impl=impl,
                      causal=is_causal, scale=scale, gqa=enable_gqa, blocks=_blocks(blocks), bias_grad=mask_grad))


attention_backward_op = torch.library.custom_op("torch_pallas::attention_backward", _compute_attention_backward,
                                               mutates_args=())
attention_backward = _autograd.direct(attention_backward_op, _compute_attention_backward)


@attention_backward_op.register_fake
def _(grad_out, query, key, value, attn_mask, out, lse, key_data, dropout_p, impl, is_causal, scale, enable_gqa,
      blocks, mask_grad, sharding_text=None, global_batch=None, global_offset=0):
    grads = [torch.empty_like(operand, dtype=grad_out.dtype) for operand in (query, key, value)]
    return grads + ([torch.empty_like(attn_mask)] if mask_grad else [])


def _setup_context(ctx, inputs, output):
    (query, key, value, attn_mask, key_data, dropout_p, impl, is_causal, scale, enable_gqa, _,
     backward_blocks, rounded, ctx.sharding_text, *ctx.block) = inputs
    out, lse, *saved = output
    ctx.options = (dropout_p, impl, is_causal, scale, enable_gqa, backward_blocks)
    if rounded:
        query, key, value = saved
    # What the backward recomputes from: no L x S matrix, the mask from its 8-byte key.
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, key_data)


def _backward(ctx, grad_out, *unused_grads):
    query, key, value, attn_mask, out, lse, key_data = ctx.saved_tensors
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    grads = attention_backward(grad_out.contiguous(), query, key, value, attn_mask, out, lse, key_data,
                               *ctx.options, mask_grad, ctx.sharding_text, *ctx.block)
    grad_mask = grads[3] if mask_grad else None
    return grads[0], grads[1], grads[2], grad_mask, *[None] * (10 + len(ctx.block))


_apply = _autograd.differentiable(attention, _compute_attention, public_name="torch_pallas.scaled_dot_product_attention",
                                  setup_context=_setup_context, backward=_backward)


def apply(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
          key_data: torch.Tensor, *, dropout_p: float, impl: str, is_causal: bool, scale: float, enable_gqa: bool,
          blocks: Optional[Sequence[int]] = None, backward_blocks: Optional[Sequence[int]] = None,
          sharding_text: Optional[str] = None, global_batch: Optional[Sequence[int]] = None,
          global_offset: int = 0) -> torch.Tensor:
    """The output of :func:`attention`, differentiable under autograd, ``torch.func``'s
    reverse-mode transforms and ``torch.compile``; float32 operands rounded where
    :func:`bfloat16_operands` says."""
    if attn_mask is not None and torch.compiler.is_compiling():
        # The mask is saved for the backward pass. Models hand every layer a no-op view of
        # one mask (transformers slices it to the key length), and torch_xla 2.9's dynamo
        # bridge returns graph outputs that are views of one tensor as one output, shifting
        # every later output (a compiled GPT-2 returned its logits as the loss). An op per
        # call gives each layer's saved mask its own value.
        attn_mask = attn_mask & True if attn_mask.dtype == torch.bool else attn_mask + 0
    return _apply(query, key, value, attn_mask, key_data, dropout_p, impl, is_causal, scale, enable_gqa, blocks,
                  backward_blocks, bfloat16_operands(query), sharding_text, global_batch, global_offset)[0]
