"""``torch_pallas::dropout``: mask from key data, applied in a Pallas kernel; the backward
kernel regenerates the mask from the same 8-byte key instead of saving it.

:func:`apply` (and :func:`apply_add`) is the differentiable entry point (built by
:func:`._autograd.differentiable` from the op's one autograd formula, with forward-mode AD and
a batching rule)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch_pallas import bridge, sharding
from torch_pallas.ops import _autograd
from torch_pallas.kernels import dropout as dropout_kernels, prng
from torch_pallas.kernels.tiling import ElementwiseBlocks


def _compute_dropout(x: torch.Tensor, key_data: torch.Tensor, p: float, impl: str, shared_over_first_dim: bool,
                     blocks: Optional[Sequence[int]], backward_blocks: Optional[Sequence[int]],
                     sharding_text: Optional[str] = None, global_shape: Optional[Sequence[int]] = None,
                     global_offset: int = 0) -> torch.Tensor:
    """``where(bernoulli(key, 1 - p), x / (1 - p), x * 0)``; arguments pre-checked.

    ``shared_over_first_dim`` draws one mask of shape ``x.shape[1:]`` for every index of
    the first dim. ``blocks`` / ``backward_blocks`` ((rows, cols) of the kernel's 2-D view,
    or ``None`` for the default) are chosen independently; the mask depends on neither.
    ``sharding_text`` (the text of x's :class:`~torch_pallas.sharding.Sharding`): the kernel
    runs on each device's shard, which gets its part of the unsharded mask.
    ``global_shape``: ``x`` is a block of a tensor of that shape (a DTensor's local shard)
    whose first element is at flat index ``global_offset`` there; it gets its part of that
    tensor's mask (:mod:`torch_pallas.dtensors`). A float64 ``x`` gets the float32 kernel's
    mask, applied in float64 outside the kernel.
    """
    if x.numel() == 0:
        return torch.empty_like(x)
    if x.dtype == torch.float64:
        # Mosaic has no float64: the kernel draws the mask a float32 tensor gets from this key.
        # ones_like, not torch.ones(device=...): torchax's dispatch mode makes a factory call's
        # tensor a torchax one, even for a CPU x
        ones = torch.ones_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)
        keep = _compute_dropout(ones, key_data, p, impl, shared_over_first_dim, blocks,
                                backward_blocks, sharding_text, global_shape, global_offset) != 0
        return torch.where(keep, x / (1 - p), x * 0)
    options = dict(p=p, impl=impl, blocks=None if blocks is None else ElementwiseBlocks(*blocks),
                   shared_over_first_dim=shared_over_first_dim)
    if sharding_text is not None:
        dims = tuple(range(x.dim()))
        return bridge.call_sharded(dropout_kernels.dropout, sharding_text, [key_data, x], [(None,), dims], [dims],
                                   noise_shape=x.shape, **options)
    if global_shape is not None:
        return _in_layout_of(x, sharding.call_on_block(dropout_kernels.dropout, key_data, x,
                                                       global_shape=global_shape, global_offset=global_offset,
                                                       **options))
    return _in_layout_of(x, bridge.call(dropout_kernels.dropout, key_data, x, **options))



def _in_layout_of(x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``output`` (contiguous) in ``x``'s layout where strides are real (CPU tensors), as torch's
    dropout gives (``empty_like(x)``: a permuted or channels_last ``x`` keeps its dim order);
    XLA and torchax tensors are always contiguous."""
    if x.device.type != "cpu" or x.is_contiguous():
        return output
    return torch.empty_like(x).copy_(output)


def _empty_in_layout_of(x: torch.Tensor) -> torch.Tensor:
    """What :func:`_in_layout_of` returns, unfilled: the fake functions' output."""
    return torch.empty_like(x) if x.device.type == "cpu" else torch.empty_like(x, memory_format=torch.contiguous_format)


dropout = torch.library.custom_op("torch_pallas::dropout", _compute_dropout, mutates_args=())


@dropout.register_fake
def _(x, key_data, *options):
    return _empty_in_layout_of(x)


def _setup_context(ctx, inputs, output):
    _, key_data, p, impl, shared_over_first_dim, ctx.blocks, ctx.backward_blocks, ctx.sharding_text, *ctx.block = inputs
    ctx.options = (p, impl, shared_over_first_dim)
    ctx.save_for_backward(key_data)  # 8 bytes: the mask is regenerated, not stored
    ctx.save_for_forward(key_data)


def _backward(ctx, grad_output):
    (key_data,) = ctx.saved_tensors
    grad_x = _apply(grad_output, key_data, *ctx.options, ctx.backward_blocks, ctx.blocks, ctx.sharding_text,
                    *ctx.block)
    return grad_x, None, None, None, None, None, None, None, None, None


def _jvp(ctx, grad_x, *_):
    # Dropout is linear in x: the tangent goes through the same mask.
    (key_data,) = ctx.saved_tensors
    return dropout(grad_x, key_data, *ctx.options, ctx.blocks, ctx.backward_blocks, ctx.sharding_text, *ctx.block)


def _batched_dropout(info, in_dims, x, key_data, p, impl, shared_over_first_dim, blocks, backward_blocks,
                     sharding_text=None, global_shape=None, global_offset=0):
    # A batched sample is not the tensor the sharding describes: vmap runs on whole tensors.
    if global_shape is not None:
        raise ValueError("torch.func.vmap of torch_pallas's dropout of a DTensor's shard: vmap the function of "
                         "whole tensors, or of the DTensor's to_local()")
    x_dim, key_dim = in_dims[:2]
    options = (p, impl)
    samples = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
    # One key for the batch (randomness="same", or a seed) with a per-tile impl: a sample's mask
    # is drawn per tile of the sample's own 2-D view, which a mask shared over a batch (drawn per
    # tile of one row) is not, so each sample runs the unbatched op, as with a key per sample.
    per_sample = key_dim is not None or (prng.per_tile(impl) and not shared_over_first_dim)
    if per_sample:
        # A key per sample (vmap's randomness="different"): each sample is the unbatched op
        # with its own key, so vmap(f)(xs)[i] == f(xs[i]) with the i-th key.
        keys = key_data.movedim(key_dim, 0) if key_dim is not None else [key_data] * len(samples)
        return torch.stack([dropout(sample, key, *options, shared_over_first_dim, blocks, backward_blocks)
                            for sample, key in zip(samples, keys)]), 0
    # Otherwise every sample gets the same mask, the unbatched op's, drawn once and shared over
    # the flattened leading dims.
    leading = 2 if shared_over_first_dim else 1
    flat = samples.reshape(-1, *samples.shape[leading:])
    return dropout(flat, key_data, *options, True, None, None).reshape(samples.shape), 0


dropout.register_vmap(_batched_dropout)


_apply = _autograd.differentiable(dropout, _compute_dropout, public_name="torch_pallas.dropout",
                                  setup_context=_setup_context, backward=_backward, jvp=_jvp)


def apply(x: torch.Tensor, key_data: torch.Tensor, *, p: float, impl: str, shared_over_first_dim: bool = False,
          blocks: Optional[Sequence[int]] = None, backward_blocks: Optional[Sequence[int]] = None,
          sharding_text: Optional[str] = None, global_shape: Optional[Sequence[int]] = None,
          global_offset: int = 0) -> torch.Tensor:
    """The op :data:`dropout` (its arguments as :func:`_compute_dropout` takes them), differentiable
    under autograd, ``torch.func`` (grad, vjp, jvp, vmap) and ``torch.compile``."""
    return _apply(x, key_data, p, impl, shared_over_first_dim, blocks, backward_blocks, sharding_text, global_shape,
                  global_offset)


def _compute_dropout_add(x: torch.Tensor, residual: torch.Tensor, key_data: torch.Tensor, p: float, impl: str,
                         sharding_text: Optional[str] = None, global_shape: Optional[Sequence[int]] = None,
                         global_offset: int = 0) -> torch.Tensor:
    """``residual + dropout(x, key_data, p, impl)`` in one kernel (x and residual of one shape
    and dtype; pre-checked; the sharding and block arguments as :func:`_compute_dropout`'s). Its
    backward is :func:`dropout` on the gradient."""
    if x.numel() == 0:
        return torch.empty_like(x)
    if x.dtype == torch.float64:
        return residual + _compute_dropout(x, key_data, p, impl, False, None, None, sharding_text, global_shape,
                                           global_offset)
    if sharding_text is not None:
        dims = tuple(range(x.dim()))
        return bridge.call_sharded(dropout_kernels.dropout_add, sharding_text, [key_data, x, residual],
                                   [(None,), dims, dims], [dims], noise_shape=x.shape, p=p, impl=impl)
    if global_shape is not None:
        return sharding.call_on_block(dropout_kernels.dropout_add, key_data, x, residual, global_shape=global_shape,
                                      global_offset=global_offset, p=p, impl=impl)
    return bridge.call(dropout_kernels.dropout_add, key_data, x, residual, p=p, impl=impl)


dropout_add = torch.library.custom_op("torch_pallas::dropout_add", _compute_dropout_add, mutates_args=())


@dropout_add.register_fake
def _(x, residual, key_data, *options):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_setup_context(ctx, inputs, output):
    _, _, key_data, ctx.p, ctx.impl, ctx.sharding_text, ctx.global_shape, ctx.global_offset = inputs
    ctx.save_for_backward(key_data)  # 8 bytes, as dropout's
    ctx.save_for_forward(key_data)


def _add_backward(ctx, grad_output):
    (key_data,) = ctx.saved_tensors
    grad_x = apply(grad_output, key_data, p=ctx.p, impl=ctx.impl, sharding_text=ctx.sharding_text,
                   global_shape=ctx.global_shape, global_offset=ctx.global_offset)
    return grad_x, grad_output, None, None, None, None, None, None


@dropout_add.register_vmap
def _(info, in_dims, x, residual, key_data, p, impl, sharding_text=None, global_shape=None, global_offset=0):
    x_dim, residual_dim, key_dim = in_dims[:3]
    dropped, _ = _batched_dropout(info, (x_dim, key_dim), x, key_data, p, impl, False, None, None, None,
                                  global_shape, global_offset)
    residual = residual.movedim(residual_dim, 0) if residual_dim is not None else residual
    return dropped + residual, 0


def _add_jvp(ctx, grad_x, grad_residual, *_):
    (key_data,) = ctx.saved_tensors
    tangent = None if grad_x is None else dropout(grad_x, key_data, ctx.p, ctx.impl, False, None, None,
                                                  ctx.sharding_text, ctx.global_shape, ctx.global_offset)
    if grad_residual is None:
        return tangent
    return grad_residual if tangent is None else tangent + grad_residual


_apply_add = _autograd.differentiable(dropout_add, _compute_dropout_add, public_name="torch_pallas.dropout_add",
                                      setup_context=_add_setup_context, backward=_add_backward, jvp=_add_jvp)


def apply_add(x: torch.Tensor, residual: torch.Tensor, key_data: torch.Tensor, *, p: float, impl: str,
              sharding_text: Optional[str] = None, global_shape: Optional[Sequence[int]] = None,
              global_offset: int = 0) -> torch.Tensor:
    """The op :data:`dropout_add`, differentiable under autograd, ``torch.func`` and
    ``torch.compile``."""
    return _apply_add(x, residual, key_data, p, impl, sharding_text, global_shape, global_offset)
