"""References the tests compare against: JAX keys for torch seeds, and bit comparisons."""

import numpy as np
import jax
import jax.numpy as jnp

# Seeds with and without high bits: the high word must reach the key.
SEEDS = (0, 1234, 2**63 + 2**40 + 7, 2**64 - 1)


def key_data(seed: int) -> np.ndarray:
    """int32 (2,) key data for a 64-bit seed, as DESIGN.md defines it."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32).view(np.int32)


def jax_key(seed: int):
    """``jax.random.key(seed)`` as it would be with x64 enabled."""
    return jax.random.wrap_key_data(jnp.asarray(key_data(seed).view(np.uint32)), impl="threefry2x32")


def as_bits(array) -> np.ndarray:
    """The raw bytes of an array, to compare floats bit for bit (NaN and -0.0 included)."""
    array = np.ascontiguousarray(np.asarray(array))
    return array.view(np.uint8) if array.dtype != np.bool_ else array


def ulp_distance(a, b) -> int:
    """Largest distance in units in the last place between two float32 arrays."""
    a = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    b = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(a - b).max()) if a.size else 0


def indrnn_reference(x, weight, h0, nonlinearity):
    """The IndRNN recurrence as a plain torch loop (run it on float64 CPU tensors)."""
    import torch

    activation = torch.relu if nonlinearity == "relu" else torch.tanh
    h, outputs = h0, []
    for x_t in x:
        h = activation(x_t + weight * h)
        outputs.append(h)
    return torch.stack(outputs), h
