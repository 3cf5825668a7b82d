"""The threefry core against JAX's own implementation and the published test vector."""

import numpy as np
import jax.numpy as jnp
from jax._src import prng as jax_prng

from torch_pallas.kernels import prng


def test_threefry2x32_known_answer():
    # Random123's known-answer test for threefry2x32_20 with key and counter all ones.
    ones = np.uint32(0xFFFFFFFF)
    y0, y1 = prng.threefry2x32(ones, ones, jnp.array([ones]), jnp.array([ones]))
    assert (int(y0[0]), int(y1[0])) == (0x1CB996FC, 0xBB002BE7)


def test_threefry2x32_matches_jax():
    rng = np.random.default_rng(0)
    k0, k1 = (np.uint32(v) for v in rng.integers(0, 2**32, 2))
    x0, x1 = (rng.integers(0, 2**32, 1000).astype(np.uint32) for _ in range(2))
    ours = prng.threefry2x32(k0, k1, jnp.asarray(x0), jnp.asarray(x1))
    theirs = jax_prng.threefry_2x32(jnp.array([k0, k1]), jnp.concatenate([jnp.asarray(x0), jnp.asarray(x1)]))
    np.testing.assert_array_equal(np.concatenate([np.asarray(o) for o in ours]), np.asarray(theirs))
