"""``torch_pallas::indrnn`` and its backward: the Pallas recurrence as differentiable ops.

:func:`apply` is the differentiable entry point (autograd, ``torch.func.grad``/``vjp``,
``torch.compile``). Time-major throughout. The forward saves its outputs (not the pre-activations): the
backward kernel takes the activation's derivative from ``h_t``.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_pallas import bridge
from torch_pallas.ops import _autograd
from torch_pallas.kernels import indrnn as indrnn_kernels


def _compute_indrnn(x: torch.Tensor, weight: torch.Tensor, h0: torch.Tensor, lengths: Optional[torch.Tensor],
                    nonlinearity: str, sharding_text: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h_t = act(x_t + weight * h_{t-1})`` over ``x`` (T, B, F); returns (output, h_n).
    Row b runs ``t < lengths[b]`` (int32 (B,)) when given. ``sharding_text``: the text of x's
    :class:`~torch_pallas.sharding.Sharding` over batch and/or features; each device runs its
    shard. Pre-checked."""
    if x.numel() == 0:
        return torch.empty_like(x), h0.to(x.dtype, copy=True)
    optional = () if lengths is None else (lengths,)
    if sharding_text is not None:
        return bridge.call_sharded(indrnn_kernels.indrnn_forward, sharding_text, [x, weight, h0, *optional],
                                   [_SEQUENCE, _FEATURES, _STATE, _BATCH], [_SEQUENCE, _STATE],
                                   nonlinearity=nonlinearity)
    output, h_n = bridge.call(indrnn_kernels.indrnn_forward, x, weight, h0, *optional, nonlinearity=nonlinearity)
    return output, h_n


indrnn = torch.library.custom_op("torch_pallas::indrnn", _compute_indrnn, mutates_args=())


# How each operand follows the (time, batch, features) sharding of the sequence.
_SEQUENCE, _STATE, _FEATURES, _BATCH = (0, 1, 2), (1, 2), (2,), (1,)


@indrnn.register_fake
def _(x, weight, h0, *options):
    return torch.empty_like(x), x.new_empty(h0.shape)


def _compute_indrnn_backward(grad_output: torch.Tensor, grad_h_n: torch.Tensor, output: torch.Tensor,
                             weight: torch.Tensor, h0: torch.Tensor, lengths: Optional[torch.Tensor],
                             nonlinearity: str, sharding_text: Optional[str] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (x, weight, h0) of :func:`indrnn` from its saved outputs."""
    if output.numel() == 0:
        return torch.zeros_like(output), torch.zeros_like(weight), grad_h_n.to(h0.dtype, copy=True)
    optional = () if lengths is None else (lengths,)
    if sharding_text is not None:
        grad_x, grad_weight_rows, grad_h0 = bridge.call_sharded(
            indrnn_kernels.indrnn_backward_weight_rows, sharding_text,
            [grad_output, grad_h_n, output, weight, h0, *optional],
            [_SEQUENCE, _STATE, _SEQUENCE, _FEATURES, _STATE, _BATCH], [_SEQUENCE, _STATE, _STATE],
            nonlinearity=nonlinearity)
        # One row per batch shard: gathered (B/shard rows, not activations) and summed in
        # order, so the weight gradient does not depend on a reduction's order.
        return grad_x, bridge.sum_rows_in_order(grad_weight_rows, sharding_text, _STATE, weight), grad_h0
    grad_x, grad_weight, grad_h0 = bridge.call(
        indrnn_kernels.indrnn_backward, grad_output, grad_h_n, output, weight, h0, *optional,
        nonlinearity=nonlinearity)
    return grad_x, grad_weight, grad_h0


indrnn_backward_op = torch.library.custom_op("torch_pallas::indrnn_backward", _compute_indrnn_backward,
                                             mutates_args=())
indrnn_backward = _autograd.direct(indrnn_backward_op, _compute_indrnn_backward)


@indrnn_backward_op.register_fake
def _(grad_output, grad_h_n, output, weight, h0, *options):
    return torch.empty_like(output), torch.empty_like(weight), torch.empty_like(h0)


def _setup_context(ctx, inputs, output):
    _, weight, h0, lengths, ctx.nonlinearity, ctx.sharding_text = inputs
    sequence, _ = output  # the op returns (output, h_n)
    ctx.save_for_backward(sequence, weight, h0, lengths)


def _backward(ctx, grad_output, grad_h_n):
    output, weight, h0, lengths = ctx.saved_tensors
    if grad_output is None:
        grad_output = torch.zeros_like(output)
    if grad_h_n is None:
        grad_h_n = torch.zeros_like(h0)
    grad_x, grad_weight, grad_h0 = indrnn_backward(
        grad_output.to(output.dtype), grad_h_n, output, weight, h0, lengths, ctx.nonlinearity, ctx.sharding_text)
    return grad_x, grad_weight, grad_h0, None, None, None


_apply = _autograd.differentiable(indrnn, _compute_indrnn, public_name="torch_pallas.indrnn",
                                  setup_context=_setup_context, backward=_backward)


def apply(x: torch.Tensor, weight: torch.Tensor, h0: torch.Tensor, lengths: Optional[torch.Tensor], *,
          nonlinearity: str, sharding_text: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op :data:`indrnn` (arguments as :func:`_compute_indrnn` takes them), differentiable
    under autograd, ``torch.func``'s reverse-mode transforms and ``torch.compile``."""
    return _apply(x, weight, h0, lengths, nonlinearity, sharding_text)
