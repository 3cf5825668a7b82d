"""Committed noise for one seed with high bits: what ``jax.random`` gave on 2026-11-25 (jax 0.7.1
and jax 0.10.2 alike, CPU) for the key the noise contract (docs/noise.md, Keys from seeds) makes
of :data:`SEED`. Both stacks' tests check that torch_pallas's results equal these exactly, so a
change of the seed-to-key rule, of JAX's threefry, or of a stack's front end shows up as a
failing test instead of silently different noise.

Regenerate only if the contract itself changes, with ``tests/reference.py``'s ``jax_key``:
``jax.random.uniform(jax_key(SEED), (4,))`` viewed as uint32, and so on.
"""

SEED = 2**63 + 5

# jax.random.uniform(key, (4,), float32), as uint32 bit patterns
UNIFORM_BITS = (0x3F578000, 0x3F6FDB92, 0x3F0B93F2, 0x3DE5E260)

# jax.random.normal(key, (4,), float32), as uint32 bit patterns
NORMAL_BITS = (0x3F803D4A, 0x3FC3CA79, 0x3DE8ABFD, 0xBF9B79ED)

# jax.random.bernoulli(key, 0.3, (16,))
BERNOULLI_P = 0.3
BERNOULLI = (0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0)

# The keep mask of dropout with p=0.5 over shape (2, 16) with impl="threefry":
# jax.random.bernoulli(key, 0.5, (2, 16))
DROPOUT_P = 0.5
DROPOUT_KEEP = ((0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1),
                (0, 1, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 1, 0))

# The same with the default impl, "tiled" (its keep probability at p=0.5 is exactly 0.5): the
# NumPy reference of the tiled impl (tests/reference.py, written from docs/noise.md) on
# 2026-12-02 (when its hash's key became the mix of the seed's words), ``dropout_keep(SEED, (2, 16), 0.5)``.
TILED_DROPOUT_KEEP = ((0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 0, 0),
                      (1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1))
