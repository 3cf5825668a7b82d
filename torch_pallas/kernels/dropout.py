"""Dropout whose mask is regenerated from the key, never stored.

``keep = bernoulli(key, 1 - p, x.shape)`` and ``y = where(keep, x / (1 - p), 0)``. The
backward pass is the same map applied to the incoming gradient with the same key, so one
kernel serves both; each call picks its own block shape, and the mask does not depend on it.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

from torch_pallas.kernels import elementwise, layout, prng


def _apply_mask(bits, values, *, keep_probability):
    keep = prng.bernoulli_from_bits(bits, keep_probability)
    # Scaling in float32 (then rounding once) keeps 16-bit inputs off the 16-bit VPU paths
    # that older TPUs lack.
    scaled = values.astype(jnp.float32) / keep_probability
    return jnp.where(keep, scaled, 0.0).astype(values.dtype)


def dropout(key_data: jax.Array, x: jax.Array, *, p: float, impl: str = prng.THREEFRY, interpret: bool,
            block_shape=None, transpose_grid: bool = False, tile=prng.DEFAULT_TILE,
            mask_shared_over_first_dim: bool = False) -> jax.Array:
    """``where(bernoulli(key, 1 - p, x.shape), x / (1 - p), 0)`` in one Pallas kernel.

    The forward pass calls it on the activation, the backward pass on the gradient with the
    same ``key_data``: both see the same mask whatever their block shapes.

    Args:
        key_data: int32 (2,) threefry key words (see :mod:`torch_pallas.seeds`).
        x: float32, bfloat16 or float16 array of any shape (fewer than 2**32 elements).
        p: drop probability in [0, 1). The keep threshold is ``float32(1 - p)``, as
            ``jax.random.bernoulli(key, 1 - p)`` computes it.
        impl, interpret, block_shape, transpose_grid, tile: see :func:`elementwise.noise_map`.
        mask_shared_over_first_dim: one mask ``bernoulli(key, 1 - p, x.shape[1:])`` for
            every index of the first dim (a recurrent net's mask shared over time); needs
            ``x.ndim >= 1``.

    Returns:
        An array like ``x``.

    Raises:
        ValueError: ``p`` outside [0, 1), and the errors of :func:`elementwise.noise_map`.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1) for the kernel (p == 1 is all zeros), got {p}")
    layout.check_numel(x.shape)
    if x.size == 0:
        return x
    transform = functools.partial(_apply_mask, keep_probability=np.float32(1.0 - p))
    if mask_shared_over_first_dim and x.ndim == 0:
        raise ValueError("mask_shared_over_first_dim needs an input with at least one dimension")
    return elementwise.noise_map(key_data, x.shape, transform, x.dtype, x, impl=impl, interpret=interpret,
                                 block_shape=block_shape, transpose_grid=transpose_grid, tile=tile,
                                 same_noise_over_first_dim=mask_shared_over_first_dim)
