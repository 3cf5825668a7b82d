"""``torch_pallas::dropout``: mask from key data, applied in a Pallas kernel; the backward
kernel regenerates the mask from the same 8-byte key instead of saving it."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch_pallas import bridge
from torch_pallas.kernels import dropout as dropout_kernels
from torch_pallas.kernels.tiling import ElementwiseBlocks


@torch.library.custom_op("torch_pallas::dropout", mutates_args=())
def dropout(x: torch.Tensor, key_data: torch.Tensor, p: float, impl: str, shared_over_first_dim: bool,
            blocks: Optional[Sequence[int]], backward_blocks: Optional[Sequence[int]]) -> torch.Tensor:
    """``where(bernoulli(key, 1 - p), x / (1 - p), 0)``; arguments pre-checked.

    ``shared_over_first_dim`` draws one mask of shape ``x.shape[1:]`` for every index of
    the first dim. ``blocks`` / ``backward_blocks`` ((rows, cols) of the kernel's 2-D view,
    or ``None`` for the default) are chosen independently; the mask depends on neither.
    """
    if x.numel() == 0:
        return torch.empty_like(x)
    return bridge.call(dropout_kernels.dropout, key_data, x, p=p, impl=impl,
                       blocks=None if blocks is None else ElementwiseBlocks(*blocks),
                       shared_over_first_dim=shared_over_first_dim)


@dropout.register_fake
def _(x, key_data, *options):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    _, key_data, *ctx.options, ctx.blocks, ctx.backward_blocks = inputs
    ctx.save_for_backward(key_data)  # 8 bytes: the mask is regenerated, not stored


def _backward(ctx, grad_output):
    (key_data,) = ctx.saved_tensors
    grad_x = dropout(grad_output, key_data, *ctx.options, ctx.backward_blocks, ctx.blocks)
    return grad_x, None, None, None, None, None, None


dropout.register_autograd(_backward, setup_context=_setup_context)
