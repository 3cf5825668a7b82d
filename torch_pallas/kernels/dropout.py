"""Dropout whose mask is regenerated from the key, never stored.

``keep = bernoulli(key, 1 - p, x.shape)`` and ``y = where(keep, x / (1 - p), x * 0)``. The
backward pass is the same map applied to the incoming gradient with the same key, so one
kernel serves both; each call picks its own blocks, and the mask does not depend on them.
With ``impl="tiled"`` the keep test reads 16-bit uniforms and ``1 - p`` is the keep
probability its threshold gives (:func:`prng.keep_probability`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from torch_pallas.kernels import arguments, elementwise, prng, tiling


def kept_values(keep, values, keep_probability) -> jax.Array:
    """float32 ``where(keep, values / keep_probability, values * 0)``: what dropout makes of
    ``values`` given where it keeps them, before the one rounding to their dtype."""
    # Scaling in float32 (then rounding once) keeps 16-bit inputs off the 16-bit VPU paths
    # that older TPUs lack.
    wide = values.astype(jnp.float32)
    # x * 0, not 0: a dropped NaN or infinity gives NaN, as torch's dropout (x * mask)
    # gives, so a diverging run still shows its NaNs.
    return jnp.where(keep, wide / keep_probability, wide * 0.0)


# Per element, for the kernel's cost estimate: the keep test, the scaling, ``x * 0`` and the
# select (as XLA counts :func:`_apply_mask`), and with a residual its add.
_MASK_FLOPS = 4


def _apply_mask(bits, values, *residual, impl, keep_probability):
    out = kept_values(prng.kept(impl, bits, keep_probability), values, keep_probability)
    if residual:
        out = out + residual[0].astype(jnp.float32)
    return out.astype(values.dtype)


def dropout(key_data: jax.Array, x: jax.Array, *, p: float, impl: str = prng.DROPOUT_DEFAULT, interpret: bool,
            blocks: tiling.ElementwiseBlocks | None = None, shared_over_first_dim: bool = False,
            global_shape=None, shard_offset: jax.Array | None = None) -> jax.Array:
    """``where(bernoulli(key, 1 - p, x.shape), x / (1 - p), x * 0)`` in one Pallas kernel.

    The forward pass calls it on the activation, the backward pass on the gradient with the
    same ``key_data``: both see the same mask whatever their blocks.

    Args:
        key_data: int32 (2,) threefry key words (see :mod:`torch_pallas.seeds`).
        x: float32, bfloat16 or float16 array of any shape.
        p: drop probability in [0, 1]. The keep threshold is ``float32(1 - p)``, as
            ``jax.random.bernoulli(key, 1 - p)`` computes it; with ``impl="tiled"`` ``p``
            rounded to a multiple of 2**-16, kept values divided by the keep probability that
            gives (:func:`prng.keep_probability`).
        impl, interpret, blocks: see :func:`elementwise.noise_map`.
        shared_over_first_dim: one mask ``bernoulli(key, 1 - p, x.shape[1:])`` for every
            index of the first dim (a recurrent net's mask shared over time); needs
            ``x.ndim >= 1``.
        global_shape, shard_offset: ``x`` is a shard of a tensor of ``global_shape``
            whose first element is at ``shard_offset`` (see :func:`elementwise.noise_map`):
            the shard gets its part of that tensor's mask.

    Returns:
        An array like ``x``.

    Raises:
        ValueError: ``p`` outside [0, 1], and the errors of :func:`elementwise.noise_map`.
    """
    return _masked(key_data, (x,), p=p, impl=impl, interpret=interpret, blocks=blocks,
                   shared_over_first_dim=shared_over_first_dim, global_shape=global_shape, shard_offset=shard_offset)


def dropout_add(key_data: jax.Array, x: jax.Array, residual: jax.Array, *, p: float, impl: str = prng.DROPOUT_DEFAULT,
                interpret: bool, blocks: tiling.ElementwiseBlocks | None = None, shared_over_first_dim: bool = False,
                global_shape=None, shard_offset: jax.Array | None = None) -> jax.Array:
    """``residual + dropout(key_data, x)`` in one Pallas kernel, computed in float32 and rounded
    once: it reads ``x`` and ``residual`` and writes the sum, where a dropout kernel followed
    by XLA's add writes the dropout's output and reads it back (Megatron's
    ``bias_dropout_add`` fusion). The mask is :func:`dropout`'s for the same key, and the
    backward pass is :func:`dropout` on the gradient (the residual's gradient is the
    gradient itself).

    Args:
        residual: an array of ``x``'s shape and dtype.
        key_data, x, p, impl, interpret, blocks, shared_over_first_dim, global_shape, shard_offset: as
            for :func:`dropout`.
    """
    return _masked(key_data, (x, residual), p=p, impl=impl, interpret=interpret, blocks=blocks,
                   shared_over_first_dim=shared_over_first_dim, global_shape=global_shape, shard_offset=shard_offset)


def _masked(key_data, operands, *, p, impl, interpret, blocks, shared_over_first_dim, global_shape, shard_offset):
    """:func:`dropout` of ``operands[0]``, plus ``operands[1]`` when given."""
    p = arguments.check_probability(p)
    x = operands[0]
    if x.size == 0:
        return x
    if x.dtype == jnp.float16:
        # The values are scaled in float32 and rounded once for every dtype; here the
        # rounding happens outside the kernel.
        return _masked(key_data, tiling.widen_float16(*operands), p=p, impl=impl, interpret=interpret,
                       blocks=blocks, shared_over_first_dim=shared_over_first_dim, global_shape=global_shape,
                       shard_offset=shard_offset).astype(x.dtype)
    transform = functools.partial(_apply_mask, impl=impl, keep_probability=prng.keep_probability(impl, p))
    residual = len(operands) - 1
    return elementwise.noise_map(key_data, x.shape, transform, x.dtype, tuple(operands), impl=impl,
                                 interpret=interpret, blocks=blocks, shared_over_first_dim=shared_over_first_dim,
                                 global_shape=global_shape, shard_offset=shard_offset,
                                 name="dropout_add" if residual else "dropout",
                                 element_cost=(_MASK_FLOPS + residual, 0), uniform_bits=prng.DROPOUT_BITS)
