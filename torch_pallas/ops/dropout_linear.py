"""``torch_pallas::dropout_linear``: ``dropout(x) @ weight.T`` in one kernel, the mask from key
data; its backward kernel regenerates the mask, and autograd keeps ``x``, never the dropped copy.

:func:`apply` is the differentiable entry point (autograd, ``torch.func``'s reverse-mode
transforms, ``torch.compile``)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch_pallas import bridge
from torch_pallas.ops import _autograd
from torch_pallas.kernels import dropout_linear as dropout_linear_kernels
from torch_pallas.sharding import Sharding


def split_dim(sharding: Sharding) -> int:
    """The one dim of ``x`` that ``sharding`` splits (:func:`_compute_dropout_linear`'s)."""
    return next(dim for dim, tiles in enumerate(sharding.tiles) if tiles > 1)


def _compute_dropout_linear(x: torch.Tensor, weight: torch.Tensor, key_data: torch.Tensor, p: float, impl: str,
                            global_shape: Optional[Sequence[int]] = None, first_row: int = 0,
                            sharding_text: Optional[str] = None) -> torch.Tensor:
    """``dropout(x, p) @ weight.T`` (``x (..., K)`` whose rows the kernels take for ``impl``,
    ``weight (N, K)`` of its dtype, or float32 for a 16-bit ``x`` taken as ``x.to(float32)``;
    pre-checked), in the weight's dtype. ``global_shape``: ``x`` is the rows from ``first_row``
    on of a tensor of that shape (a DTensor's local shard), dropped with its part of that
    tensor's mask. ``sharding_text`` (the text of x's :class:`~torch_pallas.sharding.Sharding`,
    splitting one dim into shards of whole rows the kernels take): the kernel runs on each
    device's shard, with the weight whole, and gets its part of the unsharded mask."""
    if sharding_text is not None:
        dims = tuple(range(x.dim()))
        return bridge.call_sharded(dropout_linear_kernels.dropout_linear_forward, sharding_text,
                                   [key_data, x, weight], [(None,), dims, (None, None)], [(*dims[:-1], None)],
                                   noise_shape=x.shape, p=p, impl=impl)
    return bridge.call(dropout_linear_kernels.dropout_linear_forward, key_data, x.contiguous(), weight.contiguous(),
                       p=p, impl=impl, global_shape=None if global_shape is None else tuple(global_shape),
                       first_row=first_row)


dropout_linear = torch.library.custom_op("torch_pallas::dropout_linear", _compute_dropout_linear, mutates_args=())


@dropout_linear.register_fake
def _(x, weight, key_data, p, impl, global_shape=None, first_row=0, sharding_text=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=weight.dtype)


def _compute_dropout_linear_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                     key_data: torch.Tensor, p: float, impl: str,
                                     global_shape: Optional[Sequence[int]] = None, first_row: int = 0,
                                     sharding_text: Optional[str] = None) -> list[torch.Tensor]:
    """The gradients of :func:`dropout_linear` for ``x`` and ``weight`` (its dtype, summed in
    float32 and rounded once; sharded, each shard's sum, then theirs in a fixed order)."""
    if sharding_text is not None:
        dims, rows_dims = tuple(range(x.dim())), (split_dim(Sharding.parse(sharding_text)), None, None)
        grad_x, grad_weight_rows = bridge.call_sharded(
            dropout_linear_kernels.dropout_linear_backward_weight_rows, sharding_text,
            [key_data, x, weight, grad_out], [(None,), dims, (None, None), (*dims[:-1], None)], [dims, rows_dims],
            noise_shape=x.shape, p=p, impl=impl)
        # One (N, K) row per shard: gathered (not activations) and summed in order.
        grad_weight = bridge.sum_rows_in_order(grad_weight_rows, sharding_text, rows_dims, weight)
        return [grad_x, grad_weight.to(weight.dtype)]
    grad_x, grad_weight = bridge.call(dropout_linear_kernels.dropout_linear_backward, key_data, x.contiguous(),
                                      weight.contiguous(), grad_out.contiguous(), p=p, impl=impl,
                                      global_shape=None if global_shape is None else tuple(global_shape),
                                      first_row=first_row)
    return [grad_x, grad_weight.to(weight.dtype)]


dropout_linear_backward_op = torch.library.custom_op("torch_pallas::dropout_linear_backward",
                                                     _compute_dropout_linear_backward, mutates_args=())
dropout_linear_backward = _autograd.direct(dropout_linear_backward_op, _compute_dropout_linear_backward)


@dropout_linear_backward_op.register_fake
def _(grad_out, x, weight, key_data, p, impl, global_shape=None, first_row=0, sharding_text=None):
    return [torch.empty_like(x), torch.empty_like(weight)]


def _setup_context(ctx, inputs, output):
    x, weight, key_data, ctx.p, ctx.impl, *rest = inputs
    defaults = (None, 0, None)  # (callers may leave the trailing defaults out)
    ctx.block = (*rest, *defaults[len(rest):])
    # x, not the dropped x: consumers of one x (q, k and v) share what autograd keeps.
    ctx.save_for_backward(x, weight, key_data)


def _backward(ctx, grad_out):
    x, weight, key_data = ctx.saved_tensors
    grad_x, grad_weight = dropout_linear_backward(grad_out, x, weight, key_data, ctx.p, ctx.impl, *ctx.block)
    return grad_x, grad_weight, None, None, None, None, None, None


_apply = _autograd.differentiable(dropout_linear, _compute_dropout_linear, public_name="torch_pallas.dropout_linear",
                                  setup_context=_setup_context, backward=_backward)


def apply(x: torch.Tensor, weight: torch.Tensor, key_data: torch.Tensor, *, p: float, impl: str,
          global_shape: Optional[Sequence[int]] = None, first_row: int = 0,
          sharding_text: Optional[str] = None) -> torch.Tensor:
    """The op :data:`dropout_linear`, differentiable under autograd, ``torch.func``'s reverse
    mode and ``torch.compile``."""
    return _apply(x, weight, key_data, p, impl, global_shape, first_row, sharding_text)
