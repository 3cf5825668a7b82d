"""``torch_pallas::dropout``: mask from key data, applied in a Pallas kernel; the backward
kernel regenerates the mask from the same 8-byte key instead of saving it."""

from __future__ import annotations

from typing import Sequence

import torch

from torch_pallas import bridge
from torch_pallas.kernels import dropout as dropout_kernels


def _block_shape(block_shape: Sequence[int]):
    return tuple(block_shape) if block_shape else None


@torch.library.custom_op("torch_pallas::dropout", mutates_args=())
def dropout(x: torch.Tensor, key_data: torch.Tensor, p: float, impl: str, mask_shared_over_first_dim: bool,
            block_shape: Sequence[int], backward_block_shape: Sequence[int]) -> torch.Tensor:
    """``where(bernoulli(key, 1 - p), x / (1 - p), 0)`` for ``0 <= p < 1``; arguments pre-checked.

    ``mask_shared_over_first_dim`` draws one mask of shape ``x.shape[1:]`` for every index of
    the first dim. ``block_shape`` / ``backward_block_shape`` ((rows, cols) of the kernel's
    2-D view, or empty for the default) are chosen independently; the mask depends on neither.
    """
    if x.numel() == 0:
        return torch.empty_like(x)
    return bridge.call(dropout_kernels.dropout, key_data, x, p=p, impl=impl, block_shape=_block_shape(block_shape),
                       mask_shared_over_first_dim=mask_shared_over_first_dim)


@dropout.register_fake
def _(x, key_data, p, impl, mask_shared_over_first_dim, block_shape, backward_block_shape):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    _, key_data, p, impl, mask_shared_over_first_dim, block_shape, backward_block_shape = inputs
    ctx.save_for_backward(key_data)  # 8 bytes: the mask is regenerated, not stored
    ctx.p, ctx.impl, ctx.mask_shared_over_first_dim = p, impl, mask_shared_over_first_dim
    ctx.block_shape, ctx.backward_block_shape = block_shape, backward_block_shape


def _backward(ctx, grad_output):
    (key_data,) = ctx.saved_tensors
    grad_x = dropout(grad_output, key_data, ctx.p, ctx.impl, ctx.mask_shared_over_first_dim,
                     ctx.backward_block_shape, ctx.block_shape)
    return grad_x, None, None, None, None, None, None


dropout.register_autograd(_backward, setup_context=_setup_context)
