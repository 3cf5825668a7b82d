"""Block-invariant random sampling kernels: uniform, normal and Bernoulli tensors.

With ``impl="threefry"`` the result is bit for bit ``jax.random.uniform / normal /
bernoulli(key, shape)`` for the key whose data is ``key_data``, for every block shape and
grid order. With ``impl="hardware"`` (TPU only) it is the TPU PRNG's per-tile noise, the same
for every block made of whole tiles; with ``impl="tiled"`` the same tiles filled by
:func:`prng.tiled_tile_bits` with 32 bits an element (two elements per hash), converted as
threefry's bits are.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import jax
import jax.numpy as jnp

from torch_pallas.kernels import arguments, elementwise, prng, tiling

DISTRIBUTIONS = ("uniform", "normal", "bernoulli")
# Flops and transcendentals per element of each distribution's conversion from bits, for the
# kernel's cost estimate, as XLA counts them (the normal's erf_inv: a logarithm, a square root
# and its polynomials).
_CONVERSION_COST = {"uniform": (5, 0), "normal": (46, 2), "bernoulli": (2, 0)}


def _bernoulli_as_int32(bits, p):
    # Mosaic cannot store booleans; int32 keeps every block legal for the output.
    return prng.bernoulli_from_bits(bits, p).astype(jnp.int32)


def check_distribution(distribution: str) -> str:
    return arguments.check_one_of("distribution", distribution, DISTRIBUTIONS)


def sample(key_data: jax.Array, shape, *, distribution: str, dtype=jnp.float32, p: float = 0.5,
           impl: str = prng.SAMPLING_DEFAULT, interpret: bool, blocks: tiling.ElementwiseBlocks | None = None,
           global_shape=None, shard_offset: jax.Array | None = None) -> jax.Array:
    """Samples a tensor of ``shape`` from ``distribution`` in one Pallas kernel.

    Args:
        key_data: int32 array of shape (2,), the threefry key words ``[seed >> 32, seed & 0xFFFFFFFF]``
            reinterpreted as int32.
        shape: output shape (tuple of non-negative ints).
        distribution: ``"uniform"`` ([0, 1)), ``"normal"`` (standard) or ``"bernoulli"``.
        dtype: floating output dtype for uniform and normal (bernoulli returns bool).
        p: probability of True for bernoulli, drawn as ``uniform(float32) < float32(p)``.
        impl: ``"threefry"``, ``"tiled"`` or ``"hardware"`` (TPU only; not with ``interpret``).
        interpret: run Pallas in interpret mode (any non-TPU backend).
        blocks: blocks of the 2-D view; default chosen per shape and mode. The numbers do
            not depend on it.
        global_shape, shard_offset: the output is a shard of a tensor of ``global_shape``
            whose first element is at ``shard_offset`` (see :func:`elementwise.noise_map`):
            it holds that tensor's numbers at its place.

    Raises:
        ValueError: unknown distribution or impl, ``impl="hardware"`` in interpret mode,
            blocks Mosaic would reject, or a shard the kernel cannot follow
            (:func:`elementwise.noise_map`).
    """
    check_distribution(distribution)
    shape = tuple(shape)
    out_dtype = jnp.bool_ if distribution == "bernoulli" else jnp.dtype(dtype)
    if math.prod(shape) == 0:
        return jnp.zeros(shape, out_dtype)

    float16 = out_dtype == jnp.float16
    if distribution == "bernoulli":
        transform, kernel_dtype = functools.partial(_bernoulli_as_int32, p=np.float32(p)), jnp.int32
    elif float16:
        # Mosaic has no float16: the kernel draws float32 uniforms that float16 holds
        # exactly, and the normal's float16 arithmetic runs after it.
        transform, kernel_dtype = functools.partial(prng.unit_uniform, dtype=out_dtype), jnp.float32
    elif distribution == "uniform":
        transform, kernel_dtype = functools.partial(prng.uniform_from_bits, dtype=out_dtype), out_dtype
    else:
        transform, kernel_dtype = functools.partial(prng.normal_from_bits, dtype=out_dtype), out_dtype
    # A float16 normal's conversion runs outside the kernel, which draws uniforms.
    in_kernel = "uniform" if float16 else distribution
    out = elementwise.noise_map(key_data, shape, transform, kernel_dtype, impl=impl, interpret=interpret,
                                blocks=blocks, global_shape=global_shape, shard_offset=shard_offset,
                                name=f"sample_{in_kernel}", element_cost=_CONVERSION_COST[in_kernel]).astype(out_dtype)
    return prng.normal_from_uniform(out) if float16 and distribution == "normal" else out


def uniform(key_data, shape, dtype=jnp.float32, **options):
    """``jax.random.uniform(key, shape, dtype)`` in a Pallas kernel; see :func:`sample`."""
    return sample(key_data, shape, distribution="uniform", dtype=dtype, **options)


def normal(key_data, shape, dtype=jnp.float32, **options):
    """``jax.random.normal(key, shape, dtype)`` in a Pallas kernel; see :func:`sample`."""
    return sample(key_data, shape, distribution="normal", dtype=dtype, **options)


def bernoulli(key_data, p, shape, **options):
    """``jax.random.bernoulli(key, p, shape)`` (bool) in a Pallas kernel; see :func:`sample`."""
    return sample(key_data, shape, distribution="bernoulli", p=p, **options)
