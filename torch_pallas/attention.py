"""The public attention function: :func:`scaled_dot_product_attention`, torch's, in flash
Pallas kernels whose dropout mask is regenerated from an 8-byte key."""

from __future__ import annotations

import math
import numbers

import torch

from torch_pallas import _checks, bridge, dtensors, seeds, sharding
from torch_pallas.ops import attention as attention_ops

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
                                 seed=None, generator=None, impl=None) -> torch.Tensor:
    r"""Attention with dropout in flash kernels, as
    :func:`torch.nn.functional.scaled_dot_product_attention` computes it:
    ``dropout(softmax(query @ key.transpose(-2, -1) * scale + attn_mask), dropout_p) @ value``.

    The ``L x S`` attention weights never reach device memory: a forward Pallas kernel walks
    blocks of keys with an online softmax and saves the output, the row log-sum-exp and the
    key of the dropout mask (8 bytes); the backward kernels recompute the weights and
    regenerate the mask. torch's own attention on an XLA device is its math path, which
    materialises the weights and keeps a mask as large for the backward pass.

    With ``impl="threefry"`` the mask is bit for bit ``jax.random.bernoulli(jax.random.key(seed),
    1 - dropout_p, (*batch, L, S))``, the mask :func:`torch_pallas.dropout` draws for the
    weights with the same seed: attention written out with ``torch_pallas.dropout`` on the
    weights gives the same result (to float rounding). ``impl="hardware"`` (TPU) seeds the
    TPU's PRNG per tile of each ``L x S`` plane, ``impl="tiled"`` draws the same tiles with a
    portable hash (:ref:`attention's mask <attention-mask>`).

    Args:
        query (Tensor): ``(*batch, L, E)``; float32, bfloat16 or float16 (computed in float32
            in the kernels), on a device torch_pallas runs on (:ref:`devices`). The matrix
            products take bfloat16 operands on a TPU, float32 ones rounded (Mosaic's default
            precision, as XLA's at torch_xla's default): there float32 query, key and value
            reach the kernels rounded and the backward pass keeps them so, half the bytes; the
            output and gradients stay float32. In interpret mode (CPU) float32 throughout.
        key (Tensor): ``(*batch, S, E)``, query's dtype and device; batch dims broadcast.
        value (Tensor): ``(*batch, S, Ev)``, likewise.
        attn_mask (Tensor, optional): broadcastable to ``(*batch, L, S)``: boolean (True
            takes part) or a float mask of query's dtype added to the scores (it gets a
            gradient if it requires one). A row with nothing to attend to gives zeros, as
            torch's.
        dropout_p (float): probability of dropping an attention weight, in :math:`[0, 1]`.
            Applied whenever it is above 0 (as torch's: pass 0 in evaluation).
        is_causal (bool): attend to ``s <= l`` only (top-left aligned, as torch's); not with
            ``attn_mask``.
        scale (float, optional): the scores' factor; default :math:`1/\sqrt{E}`.
        enable_gqa (bool): grouped-query attention: key's and value's heads (dim -3) are
            repeated to the query's, which must be a multiple of them.
        seed, generator, impl: as for :func:`torch_pallas.dropout` (used when
            ``dropout_p > 0``).

    An SPMD-sharded ``query`` (``xs.mark_sharding``; read in eager mode) split over its batch
    dims (batch, heads) runs shard by shard on its devices, forward and backward, with the
    unsharded mask; key, value and the mask are split with it (GQA heads too), and the output
    and gradients keep the sharding.

    Returns:
        Tensor: ``(*batch, L, Ev)`` in query's dtype.

    Raises:
        TypeError: a non-tensor, a dtype other than float32, bfloat16 or float16, operands
            of different dtypes, an ``attn_mask`` neither boolean nor of query's dtype, or a
            wrong type of ``dropout_p``, ``scale``, ``seed`` or ``generator``.
        ValueError: shapes that do not fit (as torch checks them), ``attn_mask`` with
            ``is_causal``, operands on different devices or on a device torch_pallas does not run
            on, ``dropout_p`` outside :math:`[0, 1]`, the seed and impl errors of
            :func:`torch_pallas.dropout`, and a sharded query split along its length or head
            dim, or unevenly, or whose key and value are broadcast along a split dim.

    Example::

        >>> q = torch.randn(2, 8, 128, 64, device=torch_xla.device(), requires_grad=True)
        >>> out = torch_pallas.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
        >>> out.sum().backward()   # the mask regenerated from its key
    """
    distributed = any(bridge.is_dtensor(tensor) for tensor in (query, key, value, attn_mask))
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _checks.check_float_tensor(tensor, name, dtensors=True)
    if distributed:
        check_dtensor_operands(query, key, value, attn_mask)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, {key.dtype} and {value.dtype}")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device} and "
                         f"{value.device}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype not in (torch.bool, query.dtype):
            raise TypeError(f"attn_mask must be boolean or of query's dtype {query.dtype}, got {attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask must be on query's device {query.device}, got {attn_mask.device}")
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot be combined (as in torch): put the causal "
                             "mask into attn_mask")
    dropout_p, impl = _checks.noise_arguments(dropout_p, impl, seed, generator, p_name="dropout_p")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    try:
        out_shape, _ = attention_ops.output_shapes(query, key, value, attn_mask, bool(enable_gqa))
    except ValueError as error:
        raise ValueError(f"scaled_dot_product_attention: {error}") from None
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    # Without dropout no key is drawn: the kernels take one, which they then do not read.
    key_data = (seeds.draw(seed, generator, bridge.device_of(query)) if dropout_p > 0
                else seeds.key_data_from_seed(0, bridge.device_of(query)))
    if math.prod(out_shape) == 0 or key.shape[-2] == 0:
        # Nothing to attend to (S == 0) gives zeros, as torch's; the kernels need a block.
        return query.new_zeros(out_shape)
    if distributed:
        return _on_local_shards(query, key, value, attn_mask, key_data, out_shape, dropout_p=dropout_p, impl=impl,
                                is_causal=bool(is_causal), scale=scale, enable_gqa=bool(enable_gqa))
    query_sharding = sharding.resolve(query)
    if query_sharding is not None:
        attention_ops.shard_dims(query_sharding, query, key, value, attn_mask,
                                mask_grad=attn_mask is not None and attn_mask.requires_grad)
    return attention_ops.apply(query, key, value, attn_mask, key_data, dropout_p=dropout_p, impl=impl,
                              is_causal=bool(is_causal), scale=scale, enable_gqa=bool(enable_gqa),
                              sharding_text=None if query_sharding is None else query_sharding.text)


def check_dtensor_operands(query, key, value, attn_mask) -> None:
    """Attention of DTensors: query, key and value placed alike, split over batch dims only; a
    mask, a DTensor too.

    Raises:
        TypeError: some of them DTensors and some not.
        ValueError: placements that differ, or split a length or head dim, or are Partial.
    """
    if not all(bridge.is_dtensor(tensor) for tensor in (query, key, value, *(() if attn_mask is None else (attn_mask,)))):
        raise TypeError("attention of DTensors takes a query, key, value and attn_mask that are all DTensors "
                        "(DTensor.from_local or distribute_tensor makes the others), or call it on their full_tensor()")
    dtensors.check_placements(query, "query")
    if any(tensor.device_mesh != query.device_mesh or tensor.placements != query.placements for tensor in (key, value)):
        raise ValueError(f"query, key and value must be placed alike on one mesh, got {query.placements}, "
                         f"{key.placements} and {value.placements}")
    batch = query.dim() - 2
    for placement in query.placements:
        if isinstance(placement, dtensors.Partial) or (isinstance(placement, dtensors.Shard)
                                                        and placement.dim % query.dim() >= batch):
            raise ValueError(f"attention of DTensors splits their batch dims only (batch, heads), got {placement} "
                             f"for query of shape {tuple(query.shape)}: redistribute the others")


def _on_local_shards(query, key, value, attn_mask, key_data, out_shape, **options):
    """Each rank's attention on its shards of the batch dims, drawing their planes' part of the
    unsharded dropout mask; ``attn_mask`` is read whole on each rank (redistributed to
    replicated first unless it is), the rank taking its block of the batch dims the mask does
    not broadcast over; its gradient is summed over the ranks."""
    batch = query.shape[:-2]
    mesh = query.device_mesh
    local_shape, offset = dtensors.local_block(tuple(query.shape), mesh, query.placements)
    first_plane = dtensors.flat_offset(offset[:-2], batch)
    inputs = [query, key, value]
    if attn_mask is not None:
        replicated = [dtensors.Replicate()] * mesh.ndim
        inputs.append(attn_mask if tuple(attn_mask.placements) == tuple(replicated)
                      else attn_mask.redistribute(mesh, replicated))
        lead = query.dim() - attn_mask.dim()
        block = tuple(slice(offset[lead + d], offset[lead + d] + local_shape[lead + d])
                      if d < attn_mask.dim() - 2 and d + lead >= 0 and attn_mask.shape[d] != 1 else slice(None)
                      for d in range(attn_mask.dim()))

    def local_attention(query, key, value, mask=None):
        if math.prod(local_shape) == 0:
            return query.new_zeros((*query.shape[:-1], value.shape[-1]))
        return attention_ops.apply(query, key, value, None if mask is None else mask[block], key_data,
                                   global_batch=tuple(batch), global_offset=first_plane, **options)

    return dtensors.on_local_shards(local_attention, mesh, query.placements, [(query.placements, out_shape)], *inputs)
