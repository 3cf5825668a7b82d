"""``torch_pallas::dropout_matmul``: ``dropout(weights) @ value`` in one kernel, the mask from
key data; its backward kernel regenerates the mask and saves nothing of the dropped weights.
``torch_pallas::dropout_weights``: the dropped weights themselves, with the same mask.

:func:`apply` and :func:`apply_dropout_weights` are the differentiable entry points (autograd,
``torch.func``'s reverse-mode transforms, ``torch.compile``)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch_pallas import bridge, sharding
from torch_pallas.ops import _autograd
from torch_pallas.kernels import dropout_matmul as dropout_matmul_kernels


def _call(kernel, key_data, *tensors, global_batch, global_offset, **static):
    """``kernel`` on the whole operands, or with ``global_batch`` on a block of those batch dims
    whose first plane is at flat index ``global_offset`` there (a DTensor's local shard), with
    that block's part of the mask."""
    if global_batch is None:
        return bridge.call(kernel, key_data, *tensors, **static)
    return sharding.call_on_block(kernel, key_data, *tensors, global_shape=(*global_batch, 1, 1),
                                  global_offset=global_offset, **static)


def _compute_dropout_matmul(weights: torch.Tensor, value: torch.Tensor, key_data: torch.Tensor, p: float,
                            impl: str, softmax: bool = False, global_batch: Optional[Sequence[int]] = None,
                            global_offset: int = 0) -> torch.Tensor:
    """``dropout(weights, p) @ value`` (weights ``(*batch, L, S)``, value ``(*batch, S, Ev)``, one
    float dtype; pre-checked); with ``softmax`` the weights are scores:
    ``dropout(softmax(weights, -1), p) @ value``; ``global_batch``, ``global_offset``: see
    :func:`_call`."""
    if weights.numel() == 0 or value.numel() == 0:
        return torch.zeros(*weights.shape[:-1], value.shape[-1], dtype=weights.dtype, device=weights.device)
    return _call(dropout_matmul_kernels.dropout_matmul_forward, key_data, weights, value, p=p, impl=impl,
                 softmax=softmax, global_batch=global_batch, global_offset=global_offset)


dropout_matmul = torch.library.custom_op("torch_pallas::dropout_matmul", _compute_dropout_matmul, mutates_args=())


@dropout_matmul.register_fake
def _(weights, value, key_data, p, impl, softmax=False, global_batch=None, global_offset=0):
    return weights.new_empty((*weights.shape[:-1], value.shape[-1]))


def _compute_dropout_matmul_backward(grad_out: torch.Tensor, weights: torch.Tensor, value: torch.Tensor,
                                     key_data: torch.Tensor, p: float, impl: str, softmax: bool = False,
                                     global_batch: Optional[Sequence[int]] = None,
                                     global_offset: int = 0) -> list[torch.Tensor]:
    """The gradients of :func:`dropout_matmul` for the weights (with ``softmax``, the scores)
    and the value."""
    if weights.numel() == 0 or value.numel() == 0:
        return [torch.zeros_like(weights), torch.zeros_like(value)]
    return list(_call(dropout_matmul_kernels.dropout_matmul_backward, key_data, weights, value, grad_out.contiguous(),
                      p=p, impl=impl, softmax=softmax, global_batch=global_batch, global_offset=global_offset))


dropout_matmul_backward_op = torch.library.custom_op("torch_pallas::dropout_matmul_backward",
                                                     _compute_dropout_matmul_backward, mutates_args=())
dropout_matmul_backward = _autograd.direct(dropout_matmul_backward_op, _compute_dropout_matmul_backward)


@dropout_matmul_backward_op.register_fake
def _(grad_out, weights, value, key_data, p, impl, softmax=False, global_batch=None, global_offset=0):
    return [torch.empty_like(weights), torch.empty_like(value)]


def _setup_context(ctx, inputs, output):
    weights, value, key_data, ctx.p, ctx.impl, *rest = inputs
    defaults = (False, None, 0)  # (callers may leave the trailing defaults out)
    ctx.softmax, ctx.global_batch, ctx.global_offset = (*rest, *defaults[len(rest):])
    # The weights (or the scores), not the dropped weights: the softmax before them keeps them anyway.
    ctx.save_for_backward(weights, value, key_data)


def _backward(ctx, grad_out):
    weights, value, key_data = ctx.saved_tensors
    grad_weights, grad_value = dropout_matmul_backward(grad_out, weights, value, key_data, ctx.p, ctx.impl,
                                                       ctx.softmax, ctx.global_batch, ctx.global_offset)
    return grad_weights, grad_value, None, None, None, None, None, None


_apply = _autograd.differentiable(dropout_matmul, _compute_dropout_matmul, public_name="torch_pallas.dropout_matmul",
                                  setup_context=_setup_context, backward=_backward)


def apply(weights: torch.Tensor, value: torch.Tensor, key_data: torch.Tensor, *, p: float, impl: str,
          softmax: bool = False, global_batch: Optional[Sequence[int]] = None, global_offset: int = 0) -> torch.Tensor:
    """The op :data:`dropout_matmul`, differentiable under autograd, ``torch.func``'s reverse
    mode and ``torch.compile``."""
    return _apply(weights, value, key_data, p, impl, softmax, global_batch, global_offset)


def _compute_dropout_weights(weights: torch.Tensor, key_data: torch.Tensor, p: float, impl: str,
                             global_batch: Optional[Sequence[int]] = None, global_offset: int = 0) -> torch.Tensor:
    """``dropout(weights, p)`` of ``(*batch, L, S)`` weights with :func:`_compute_dropout_matmul`'s
    mask (pre-checked; ``global_batch``, ``global_offset``: see :func:`_call`)."""
    if weights.numel() == 0:
        return torch.empty_like(weights)
    return _call(dropout_matmul_kernels.dropout_weights, key_data, weights.contiguous(), p=p, impl=impl,
                 global_batch=global_batch, global_offset=global_offset)


dropout_weights = torch.library.custom_op("torch_pallas::dropout_weights", _compute_dropout_weights,
                                          mutates_args=())


@dropout_weights.register_fake
def _(weights, key_data, p, impl, global_batch=None, global_offset=0):
    return torch.empty_like(weights, memory_format=torch.contiguous_format)


def _weights_setup_context(ctx, inputs, output):
    _, key_data, *ctx.options = inputs
    ctx.save_for_backward(key_data)  # 8 bytes, as dropout's
    ctx.save_for_forward(key_data)


def _weights_backward(ctx, grad_output):
    (key_data,) = ctx.saved_tensors
    return _apply_dropout_weights(grad_output, key_data, *ctx.options), None, None, None, None, None


def _weights_jvp(ctx, grad_weights, *_):
    # Dropout is linear in the weights: the tangent goes through the same mask.
    (key_data,) = ctx.saved_tensors
    return dropout_weights(grad_weights, key_data, *ctx.options)


_apply_dropout_weights = _autograd.differentiable(
    dropout_weights, _compute_dropout_weights, public_name="torch_pallas.dropout_weights",
    setup_context=_weights_setup_context, backward=_weights_backward, jvp=_weights_jvp)


def apply_dropout_weights(weights: torch.Tensor, key_data: torch.Tensor, *, p: float, impl: str,
                          global_batch: Optional[Sequence[int]] = None, global_offset: int = 0) -> torch.Tensor:
    """The op :data:`dropout_weights`, differentiable under autograd, ``torch.func`` and
    ``torch.compile``."""
    return _apply_dropout_weights(weights, key_data, p, impl, global_batch, global_offset)
