"""``torch_pallas::dropout_matmul``: ``dropout(weights) @ value`` in one kernel, the mask from
key data; its backward kernel regenerates the mask and saves nothing of the dropped weights.

:func:`apply` is the differentiable entry point (autograd, ``torch.func``'s reverse-mode
transforms, ``torch.compile``)."""

from __future__ import annotations

import torch

from torch_pallas import bridge
from torch_pallas.ops import _autograd
from torch_pallas.kernels import dropout_matmul as dropout_matmul_kernels


def _compute_dropout_matmul(weights: torch.Tensor, value: torch.Tensor, key_data: torch.Tensor, p: float,
                            impl: str, softmax: bool = False) -> torch.Tensor:
    """``dropout(weights, p) @ value`` (weights ``(*batch, L, S)``, value ``(*batch, S, Ev)``, one
    float dtype; pre-checked); with ``softmax`` the weights are scores:
    ``dropout(softmax(weights, -1), p) @ value``."""
    if weights.numel() == 0 or value.numel() == 0:
        return torch.zeros(*weights.shape[:-1], value.shape[-1], dtype=weights.dtype, device=weights.device)
    return bridge.call(dropout_matmul_kernels.dropout_matmul_forward, key_data, weights, value, p=p, impl=impl,
                       softmax=softmax)


dropout_matmul = torch.library.custom_op("torch_pallas::dropout_matmul", _compute_dropout_matmul, mutates_args=())


@dropout_matmul.register_fake
def _(weights, value, key_data, p, impl, softmax=False):
    return weights.new_empty((*weights.shape[:-1], value.shape[-1]))


def _compute_dropout_matmul_backward(grad_out: torch.Tensor, weights: torch.Tensor, value: torch.Tensor,
                                     key_data: torch.Tensor, p: float, impl: str,
                                     softmax: bool = False) -> list[torch.Tensor]:
    """The gradients of :func:`dropout_matmul` for the weights (with ``softmax``, the scores)
    and the value."""
    if weights.numel() == 0 or value.numel() == 0:
        return [torch.zeros_like(weights), torch.zeros_like(value)]
    return list(bridge.call(dropout_matmul_kernels.dropout_matmul_backward, key_data, weights, value,
                            grad_out.contiguous(), p=p, impl=impl, softmax=softmax))


dropout_matmul_backward_op = torch.library.custom_op("torch_pallas::dropout_matmul_backward",
                                                     _compute_dropout_matmul_backward, mutates_args=())
dropout_matmul_backward = _autograd.direct(dropout_matmul_backward_op, _compute_dropout_matmul_backward)


@dropout_matmul_backward_op.register_fake
def _(grad_out, weights, value, key_data, p, impl, softmax=False):
    return [torch.empty_like(weights), torch.empty_like(value)]


def _setup_context(ctx, inputs, output):
    weights, value, key_data, ctx.p, ctx.impl, *softmax = inputs
    ctx.softmax = bool(softmax and softmax[0])
    # The weights (or the scores), not the dropped weights: the softmax before them keeps them anyway.
    ctx.save_for_backward(weights, value, key_data)


def _backward(ctx, grad_out):
    weights, value, key_data = ctx.saved_tensors
    grad_weights, grad_value = dropout_matmul_backward(grad_out, weights, value, key_data, ctx.p, ctx.impl,
                                                       ctx.softmax)
    return grad_weights, grad_value, None, None, None, None


_apply = _autograd.differentiable(dropout_matmul, _compute_dropout_matmul, public_name="torch_pallas.dropout_matmul",
                                  setup_context=_setup_context, backward=_backward)


def apply(weights: torch.Tensor, value: torch.Tensor, key_data: torch.Tensor, *, p: float, impl: str,
          softmax: bool = False) -> torch.Tensor:
    """The op :data:`dropout_matmul`, differentiable under autograd, ``torch.func``'s reverse
    mode and ``torch.compile``."""
    return _apply(weights, value, key_data, p, impl, softmax)
