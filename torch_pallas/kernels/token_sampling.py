"""Per-request seeded token sampling: row ``b``'s token is a function of its logits row, its
seed, its position and its sampling parameters alone, whatever the batch, the row's slot, the
vocabulary blocks, the device or the stack.

What a row draws (the contract, stated once here; docs/sampling.md links it):

1. **Its key.** The seed's two 32-bit words (``seed >> 32``, ``seed & 0xFFFFFFFF``) go through
   Threefry-2x32-20 as the counter under the fixed key :data:`SEED_MIX`; the two output words
   key a second Threefry-2x32-20 whose counter is ``(0, position)``: :func:`row_key_words`. Two
   block ciphers at full strength, not a counter offset, so seeds ``s, s + 1`` and positions
   ``p, p + 1`` (what users number requests and tokens by) give unrelated keys.
2. **Its noise.** Vocabulary entry ``v`` gets the 32 bits ``jax.random.bits(row_key, (V,))[v]``
   (partitionable Threefry-2x32-20 of the counter ``(0, v)``: :func:`torch_pallas.kernels.prng.threefry_bits`),
   made a uniform ``u = (2 * (bits >> 9) + 1) / 2**24`` in (0, 1) and a Gumbel number
   ``g = -log(-log(u))``: :func:`gumbel_from_bits`.
3. **Its kept set**: the tokens whose logit is at least a threshold (:func:`keep_threshold`), the
   intersection of min-p's, top-k's and, over what those keep, top-p's sets; every one holds the
   largest logit. Ties at a threshold are kept together.
4. **Its token**: the lowest index of the largest ``logit + T * g`` over the kept set (the
   Gumbel-max trick: exactly a draw from ``softmax(logits / T)`` restricted to the set).
   ``T == 0`` keeps only the largest logit: ``torch.argmax``'s token.

Every decision is made by integer operations, comparisons, maxima, and elementwise float32
arithmetic: the logarithms and exponentials are written here in multiplies and adds
(:func:`portable_log`, :func:`portable_exp`, after Cephes' ``logf`` and ``expf``), not left to
each device's transcendental units, whose last bits differ; sums of probability are integer sums
of masses in fixed point (to 2**-36), exact in any order. So a row split into any batch, slot, vocabulary
blocks or shards (whose partial maxima, counts and sums are exact) decides alike wherever one
compiler compiles it. Across compilers one difference remains: where a compiler contracts
``a * b + c`` into a fused multiply-add (XLA's CPU compiler does, for 23 % of random float32
operands, 2026-12-02, and no select or barrier between them stopped it reliably), the Gumbel
numbers' last bits may differ, and with them a token whose two best scores are that close
(how often has not been measured; a TPU would tell).
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import calls, prng, tiling

# The fixed key under which a seed's words are mixed (:func:`row_key_words`): the golden ratio's
# first digits (0x9E3779B9, Threefry's and TEA's constant) and pi's next (0x243F6A88), so that no
# generator of this package shares it (the tiled impl's is Random123's pi digits, prng.TILED_KEY_MIX).
SEED_MIX = (np.uint32(0x9E3779B9), np.uint32(0x243F6A88))
# Probability masses (of the largest one's, which is 1) are summed for the top-p threshold as
# MASS_WORDS base-2**MASS_SPLIT digits each (the mass truncated to 2**-36: exact for masses above
# 2**-12, within 2**-36 below), whose uint32 sums are exact, in any order, for vocabularies below
# MAX_VOCABULARY.
MASS_SPLIT = 12
MASS_WORDS = 3
MAX_VOCABULARY = 2**20
# Temperatures below this sample greedily: vLLM's _SAMPLING_EPS.
GREEDY_BELOW = np.float32(1e-5)
# Below this, exp underflows into subnormals, which some devices flush: treated as 0.
_EXP_FLOOR = np.float32(-86.0)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_POLYNOMIAL = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                                4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_LOG_POLYNOMIAL = tuple(np.float32(c) for c in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1,
                                                -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
                                                2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1))
_SQRT_HALF = np.float32(0.707106781186547524)
_MANTISSA = np.int32(0x7FFFFF)
_HALF_EXPONENT = np.int32(0x3F000000)
_SIGN = np.uint32(0x80000000)


def row_key_words(seed_words: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint32 key words (each of shape ``positions.shape``) of the rows whose seeds' words are
    ``seed_words`` (int32 or uint32, ``(..., 2)``: high word, low word) at ``positions``
    (int32 or uint32): step 1 of the contract."""
    words = lax.bitcast_convert_type(seed_words, jnp.uint32) if seed_words.dtype == jnp.int32 else seed_words
    seed_key = prng.threefry2x32(*SEED_MIX, words[..., 0], words[..., 1])
    position = lax.convert_element_type(positions, jnp.uint32) if positions.dtype != jnp.uint32 else positions
    return prng.threefry2x32(*seed_key, jnp.zeros_like(position), position)


def _polynomial(coefficients, x):
    result = coefficients[0]
    for coefficient in coefficients[1:]:
        result = result * x + coefficient
    return result


def portable_log(x: jax.Array) -> jax.Array:
    """The natural logarithm of positive normal float32 ``x`` (Cephes' ``logf``: within an ulp),
    from float32 multiplies and adds and integer bit operations alone (NaN stays NaN)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    exponent = (bits >> 23) - np.int32(126)
    mantissa = lax.bitcast_convert_type((bits & _MANTISSA) | _HALF_EXPONENT, jnp.float32)  # [0.5, 1)
    small = mantissa < _SQRT_HALF
    exponent = lax.convert_element_type(jnp.where(small, exponent - 1, exponent), jnp.float32)
    m = jnp.where(small, mantissa + mantissa, mantissa) - np.float32(1.0)
    z = m * m
    y = _polynomial(_LOG_POLYNOMIAL, m) * m * z
    y = y + exponent * _LN2_LOW
    y = y - np.float32(0.5) * z
    return jnp.where(x == x, (m + y) + exponent * _LN2_HIGH, x)


def portable_exp(x: jax.Array) -> jax.Array:
    """``exp(x)`` for float32 ``x <= 0`` (``-inf`` too; 0 below -86, where it would be subnormal;
    ``exp(0) == 1`` exactly; NaN stays NaN), Cephes' ``expf`` in float32 multiplies and adds and
    integer bit operations alone."""
    clamped = jnp.maximum(x, _EXP_FLOOR)
    n = jnp.floor(clamped * _LOG2E + np.float32(0.5))
    r = clamped - n * _LN2_HIGH
    r = r - n * _LN2_LOW
    p = _polynomial(_EXP_POLYNOMIAL, r) * (r * r) + r + np.float32(1.0)
    scaled = lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32)
                                      + (lax.convert_element_type(n, jnp.int32) << 23), jnp.float32)
    return jnp.where(x == x, jnp.where(x < _EXP_FLOOR, np.float32(0.0), scaled), x)


def gumbel_from_bits(bits: jax.Array) -> jax.Array:
    """float32 Gumbel numbers ``-log(-log(u))`` of uint32 ``bits``, ``u = (2 * (bits >> 9) + 1)
    / 2**24``: an odd multiple of 2**-24, never 0 or 1, so every value is finite (in [-2.8, 16.7])."""
    odd = lax.convert_element_type((bits >> np.uint32(9)) * np.uint32(2) + np.uint32(1), jnp.int32)
    u = lax.convert_element_type(odd, jnp.float32) * np.float32(2.0**-24)
    return -portable_log(-portable_log(u))


def ordered_key(logits: jax.Array) -> jax.Array:
    """uint32 keys in the order of float32 ``logits`` (``-inf`` lowest, ``+inf`` highest; ``-0.0``
    and ``0.0`` one key, as they compare equal): a threshold on logits is a threshold on keys,
    searched bit by bit."""
    bits = lax.bitcast_convert_type(logits, jnp.uint32)
    # Negative: 2**32 - bits (-0.0's is 0.0's, 2**31); positive: above them all.
    return jnp.where(bits >= _SIGN, np.uint32(0) - bits, bits | _SIGN)


def _reciprocal(x: jax.Array) -> jax.Array:
    """``1 / x`` for positive normal float32 ``x`` to about an ulp, in multiplies and adds: a
    bit-pattern first guess and four Newton steps (a device's divide may round otherwise)."""
    guess = lax.bitcast_convert_type(np.int32(0x7EF311C3) - lax.bitcast_convert_type(x, jnp.int32), jnp.float32)
    for _ in range(4):
        guess = guess * (np.float32(2.0) - x * guess)
    return guess


def _bisect(predicate, start: jax.Array) -> jax.Array:
    """The largest ``t`` of ``start``'s unsigned dtype (per row, zeros: :func:`_search_start`)
    with ``predicate(t)`` true, for a predicate true at 0 and monotone (true, then false, as ``t``
    grows): a step of one bit for each of its bits."""
    def step(bit, t):
        candidate = _with_bit(t, bit=bit)
        return jnp.where(predicate(candidate), candidate, t)
    return lax.fori_loop(0, start.dtype.itemsize * 8, step, start)


def _with_bit(t: jax.Array, *, bit) -> jax.Array:
    """``t`` with bit ``bit`` set, counted from the most significant (``bit`` an int or traced)."""
    shift = lax.convert_element_type(t.dtype.itemsize * 8 - 1 - bit, t.dtype)
    return t | (lax.convert_element_type(1, t.dtype) << shift)


def _chosen(candidate, t, *reduced_and_rows, holds):
    return jnp.where(holds(*reduced_and_rows), candidate, t)


def bisect_in_steps(steps, partial, kind: str, holds, shard_arguments: tuple, row_arguments: tuple):
    """:class:`InTrace`'s ``bisect`` search (:func:`_bisect`'s) for an executor whose steps are calls
    of their own: the candidates' partials (one per bit of the keys, ``shard_arguments[0]``)
    reduced one after another."""
    keys = shard_arguments[0]
    t = steps.apply(_search_start, keys)
    for bit in range(keys.dtype.itemsize * 8):
        candidate = steps.apply(_with_bit, t, bit=bit)
        reduced = steps.reduce(kind, steps.apply(partial, *shard_arguments, candidate))
        reduced = reduced if isinstance(reduced, tuple) else (reduced,)
        t = steps.apply(_chosen, candidate, t, *reduced, *row_arguments, holds=holds)
    return t


def _mass_words(masses: jax.Array) -> tuple[jax.Array, ...]:
    """The :data:`MASS_WORDS` base-2**MASS_SPLIT digits of masses in [0, 1], most significant
    first (1 is the digit 2**MASS_SPLIT then zeros), as uint16: each step of a search reads them
    all. Each step here is exact in float32: a power-of-two scaling, a floor, and the fraction left."""
    words, rest = [], masses
    for _ in range(MASS_WORDS):
        scaled = rest * np.float32(2.0**MASS_SPLIT)
        digit = jnp.floor(scaled)
        words.append(lax.convert_element_type(lax.convert_element_type(digit, jnp.int32), jnp.uint16))
        rest = scaled - digit
    return tuple(words)


def _as_float(*sums: jax.Array) -> jax.Array:
    """float32 of the exact sum ``sum(sums[i] * 2**(MASS_SPLIT * (MASS_WORDS - 1 - i)))`` of
    digits (:func:`_mass_words`), in units of the last digit: rounded at each of a fixed sequence
    of additions after exact power-of-two scalings, the same on every device, fused or not."""
    total = lax.convert_element_type(sums[0], jnp.float32)
    for word in sums[1:]:
        total = total * np.float32(2.0**MASS_SPLIT) + lax.convert_element_type(word, jnp.float32)
    return total


class InTrace:
    """Runs the sampler's steps in the caller's JAX trace, their per-row partials combined across
    vocabulary shards by ``reduce`` (``reduce(kind, x)``, kind ``"max"``, ``"min"`` or ``"sum"``;
    ``None``: the logits are whole rows). :func:`across` gives the one of a ``shard_map`` axis.

    :func:`keep_threshold`, :func:`token_logprobs` and :func:`best_of_shards` are written against
    this interface, which an executor of shards that cannot share a trace also implements (each
    step a call of its own on each rank's shard, the reductions collectives between them:
    ``torch_pallas.ops.token_sampling.AcrossRanks``, for DTensors):

    - ``apply(function, *arrays, **static)``: ``function`` (a module-level JAX function) of a
      shard's logits and per-row arrays;
    - ``reduce(kind, partial)``: a partial, or a tuple of them, combined across the shards;
    - ``bisect(partial, kind, holds, shard_arguments, row_arguments)``: the largest ``t`` (of
      the dtype of ``shard_arguments[0]``, the search keys: :func:`_search_keys`) per row at
      which ``holds(*reduced, *row_arguments)`` is true, ``reduced`` the reduction of
      ``partial(*shard_arguments, t)`` (:func:`_bisect`'s search; :func:`bisect_in_steps`, one
      step after another).
    """

    def __init__(self, reduce=None):
        self._reduce = reduce

    def apply(self, function, *arrays, **static):
        return function(*arrays, **static)

    def reduce(self, kind: str, partial):
        if self._reduce is None:
            return partial
        if isinstance(partial, tuple):
            return tuple(self._reduce(kind, x) for x in partial)
        return self._reduce(kind, partial)

    def bisect(self, partial, kind: str, holds, shard_arguments: tuple, row_arguments: tuple) -> jax.Array:
        def predicate(t):
            reduced = self.reduce(kind, partial(*shard_arguments, t))
            return holds(*(reduced if isinstance(reduced, tuple) else (reduced,)), *row_arguments)
        return _bisect(predicate, _search_start(shard_arguments[0]))


def _clean(logits: jax.Array) -> jax.Array:
    """float32 logits, NaN as ``-inf`` (never drawn)."""
    logits = logits.astype(jnp.float32)
    return jnp.where(logits == logits, logits, -jnp.inf)


def _greedy(temperature: jax.Array) -> jax.Array:
    return temperature < GREEDY_BELOW


def _masses(logits: jax.Array, largest: jax.Array, temperature: jax.Array) -> jax.Array:
    """``exp((logit - max) / T)`` (:func:`portable_exp`; 1 for the largest), ``T`` 1 for greedy rows."""
    scale = _reciprocal(jnp.where(_greedy(temperature), np.float32(1.0), temperature))
    # -inf - -inf is NaN in a row of -inf alone: its one kept token is then index 0 whatever this is.
    return portable_exp((_clean(logits) - largest[:, None]) * scale[:, None])


# The steps of keep_threshold: arrays of a shard's logits, their per-row partials ("*_partial"), and
# per-row functions of the partials' reductions.

def _search_keys(logits: jax.Array) -> jax.Array:
    """The keys the thresholds are searched over: :func:`ordered_key`'s, or for bfloat16 logits
    their top 16 bits, as uint16 (the rest are zeros), which halve each step's reads and the
    steps. A threshold over them is the same kept set as over the whole keys (:func:`_or_greedy`)."""
    keys = ordered_key(_clean(logits))
    if logits.dtype == jnp.bfloat16:
        return lax.convert_element_type(keys >> np.uint32(16), jnp.uint16)
    return keys


def _search_start(keys: jax.Array) -> jax.Array:
    return jnp.zeros(keys.shape[:1], keys.dtype)


def _largest_partial(logits: jax.Array) -> jax.Array:
    return jnp.max(_clean(logits), axis=-1)


def _no_threshold(largest: jax.Array) -> jax.Array:
    return jnp.zeros(largest.shape, jnp.uint32)


def _min_p_partial(keys, masses, min_p):
    return jnp.min(jnp.where(masses >= min_p[:, None], keys, np.array(np.iinfo(keys.dtype).max, keys.dtype)), axis=-1)


def _count_at_least_partial(keys, t):
    return jnp.sum(keys >= t[:, None], axis=-1, dtype=jnp.int32)


def _holds_top_k(count, top_k):
    return count >= top_k


def _kept_mass_words(keys, masses, threshold):
    return _mass_words(jnp.where(keys >= threshold[:, None], masses, np.float32(0.0)))


def _kept_mass_partial(*words):
    return tuple(jnp.sum(word, axis=-1, dtype=jnp.uint32) for word in words)


def _mass_above_partial(keys, *words_and_t):
    *words, t = words_and_t
    above = keys > t[:, None]
    return tuple(jnp.sum(jnp.where(above, word, np.uint16(0)), axis=-1, dtype=jnp.uint32) for word in words)


def _top_p_bound(*sums_and_top_p):
    *sums, top_p = sums_and_top_p
    return top_p * _as_float(*sums)


def _holds_top_p_above(*sums_and_bound):
    *sums, bound = sums_and_bound
    return _as_float(*sums) >= bound


def _raised(threshold, candidate, on):
    return jnp.maximum(threshold, jnp.where(on, candidate, np.zeros((), threshold.dtype)))


def _raised_by_min_p(threshold, least, min_p):
    return _raised(threshold, least, min_p > 0)


def _raised_by_top_k(threshold, kth, top_k):
    return _raised(threshold, kth, top_k > 0)


def _raised_by_top_p(threshold, last, top_p):
    # The last key with at least top_p above it; the threshold is the next (everything above it
    # holds less). At t = 0 the mass above is the whole (top_p <= 1).
    most = np.array(np.iinfo(last.dtype).max, last.dtype)
    nucleus = jnp.where(last == most, last, last + np.ones((), last.dtype))
    return _raised(threshold, nucleus, top_p < 1)


def _or_greedy(threshold, largest, temperature):
    """The uint32 threshold over :func:`ordered_key`'s keys of a threshold over the search keys
    (their top bits), or a greedy row's (the largest logit's key)."""
    widened = lax.convert_element_type(threshold, jnp.uint32) << np.uint32(32 - threshold.dtype.itemsize * 8)
    return jnp.where(_greedy(temperature), ordered_key(largest), widened)


def keep_threshold(logits: jax.Array, temperature: jax.Array, top_k=None, top_p=None, min_p=None,
                   steps: InTrace | None = None) -> jax.Array:
    """uint32 ``(B,)`` threshold of each row's kept set: a token is kept where its
    :func:`ordered_key` is at least it. Step 3 of the contract:

    - ``T == 0``: the largest logit's key (greedy). NaN logits count as ``-inf``: never kept.
    - ``T < 1e-5`` counts as 0, as in vLLM (``_SAMPLING_EPS``), and so does a negative ``T`` (its
      padding rows').
    - ``min_p`` (``(B,)`` float32, 0: none): the smallest key among tokens whose mass
      ``exp((logit - max) / T)`` (:func:`portable_exp`; the largest token's is 1) is at least
      ``min_p``: vLLM's "probability at least min_p times the largest" (it applies min-p before
      top-k and top-p; transformers applies it after top-p, on the renormalised distribution).
    - ``top_k`` (``(B,)`` int32, 0 or at least V: none): the k-th largest key (ties at it kept).
    - ``top_p`` (``(B,)`` float32, 1: none): over the tokens the others keep, the smallest key
      whose tokens above it hold less than ``top_p`` of their mass (summed exactly in fixed
      point, each mass truncated to 2**-36 of the largest's), so the kept tokens are the fewest largest whose mass reaches
      ``top_p``, ties kept: transformers' and vLLM's rule (sort ascending, drop where the
      cumulative probability is at most ``1 - top_p``), but for the order they give ties.

    ``steps`` (:class:`InTrace`: default, whole rows) runs the steps on vocabulary shards and
    combines their partials: exact for the maxima and the integer counts and sums, so a sharded
    row decides as the whole row.
    """
    steps = steps or InTrace()
    largest = steps.reduce("max", steps.apply(_largest_partial, logits))
    if min_p is None and top_k is None and top_p is None:
        return steps.apply(_or_greedy, steps.apply(_no_threshold, largest), largest, temperature)
    keys = steps.apply(_search_keys, logits)
    threshold = steps.apply(_search_start, keys)
    masses = steps.apply(_masses, logits, largest, temperature)
    if min_p is not None:
        least = steps.reduce("min", steps.apply(_min_p_partial, keys, masses, min_p))
        threshold = steps.apply(_raised_by_min_p, threshold, least, min_p)
    if top_k is not None:
        kth = steps.bisect(_count_at_least_partial, "sum", _holds_top_k, (keys,), (top_k,))
        threshold = steps.apply(_raised_by_top_k, threshold, kth, top_k)
    if top_p is not None:
        words = steps.apply(_kept_mass_words, keys, masses, threshold)
        total = steps.reduce("sum", steps.apply(_kept_mass_partial, *words))
        bound = steps.apply(_top_p_bound, *total, top_p)
        last = steps.bisect(_mass_above_partial, "sum", _holds_top_p_above, (keys, *words), (bound,))
        threshold = steps.apply(_raised_by_top_p, threshold, last, top_p)
    return steps.apply(_or_greedy, threshold, largest, temperature)


def _gumbel_max_kernel(offset_ref, rows_ref, logits_ref, token_ref, score_ref, *, block_vocabulary: int):
    """One (rows, vocabulary) block: each row's best ``logit + T * g`` over its kept tokens, and
    the lowest index holding it, folded into the running best of the blocks before (the output
    blocks stay resident along the vocabulary axis). A row's columns are entries ``start`` to
    ``start + width - 1`` of its vocabulary (a part of a folded row: :func:`gumbel_max`)."""
    j = pl.program_id(1)
    rows = rows_ref[...]
    k0 = lax.bitcast_convert_type(rows[:, 0:1], jnp.uint32)
    k1 = lax.bitcast_convert_type(rows[:, 1:2], jnp.uint32)
    threshold = lax.bitcast_convert_type(rows[:, 2:3], jnp.uint32)
    temperature = lax.bitcast_convert_type(rows[:, 3:4], jnp.float32)
    start, width = rows[:, 4:5], rows[:, 5:6]
    logits = logits_ref[...].astype(jnp.float32)
    local = lax.broadcasted_iota(jnp.int32, logits.shape, 1) + j * block_vocabulary
    index = local + start + offset_ref[0]
    bits = prng.threefry_bits(k0, k1, lax.convert_element_type(index, jnp.uint32))
    score = logits + temperature * gumbel_from_bits(bits)
    kept = (ordered_key(logits) >= threshold) & (local < width)
    score = jnp.where(kept & (score == score), score, -jnp.inf)
    best = jnp.max(score, axis=1, keepdims=True)
    # Where every score of the block is -inf (nothing kept here), its lowest index. In float32 (exact
    # below 2**24: MAX_VOCABULARY), as Mosaic reduces across lanes in float32 and bfloat16 alone.
    first = jnp.min(jnp.where(score == best, lax.convert_element_type(index, jnp.float32), np.float32(2**24)),
                    axis=1, keepdims=True)
    first = lax.convert_element_type(first, jnp.int32)

    @pl.when(j == 0)
    def _():
        score_ref[...] = best
        token_ref[...] = first

    @pl.when(j > 0)
    def _():
        better = best > score_ref[...]
        token_ref[...] = jnp.where(better, first, token_ref[...])
        score_ref[...] = jnp.where(better, best, score_ref[...])


# Interpret mode pays a host round per grid step: blocks of up to this many logits.
_INTERPRET_BLOCK_ELEMENTS = 2**22
# TPU: rows of a block (a vreg's sublanes) and lanes of vocabulary (not tuned on hardware).
_TPU_BLOCK_VOCABULARY = 2048


def default_fold(batch: int, vocabulary: int, interpret: bool) -> int:
    """How many rows of :func:`gumbel_max`'s kernel each logits row becomes: on TPU, a batch below
    a vreg's 8 sublanes fills them with parts of its rows (a block of one row computes 8), where
    each part keeps at least a vreg's 128 lanes; 1 elsewhere."""
    if interpret or batch >= tiling.SUBLANES:
        return 1
    return max(1, min(tiling.SUBLANES // batch, vocabulary // tiling.LANES))


def default_blocks(batch: int, vocabulary: int, interpret: bool) -> tuple[int, int]:
    """``(block_rows, block_vocabulary)`` of :func:`gumbel_max` where none are given: whole rows
    in interpret mode (as many as fit :data:`_INTERPRET_BLOCK_ELEMENTS`), 8 rows by 2048 lanes on TPU."""
    if interpret:
        rows = max(_INTERPRET_BLOCK_ELEMENTS // vocabulary // tiling.SUBLANES * tiling.SUBLANES, tiling.SUBLANES)
        return min(rows, batch), vocabulary
    return min(tiling.SUBLANES, batch), min(tiling.round_up(vocabulary, tiling.LANES), _TPU_BLOCK_VOCABULARY)


def _rows_of(seed_words, positions, temperature, threshold):
    # A greedy row's score is its logit: ties at the largest go to the lowest index, not to noise.
    noise_scale = jnp.where(_greedy(temperature), np.float32(0.0), temperature)
    words = (*row_key_words(seed_words, positions), threshold, noise_scale)
    return jnp.stack([lax.bitcast_convert_type(word, jnp.int32) for word in words], axis=1)


def sampling_rows(logits: jax.Array, seed_words: jax.Array, positions: jax.Array, temperature: jax.Array,
                  top_k: jax.Array | None = None, top_p: jax.Array | None = None, min_p: jax.Array | None = None,
                  *, steps: InTrace | None = None) -> jax.Array:
    """int32 ``(B, 4)``: each row's key words (:func:`row_key_words`), kept set's threshold
    (:func:`keep_threshold`, whose ``steps`` this passes on) and noise scale (its temperature, 0
    for a greedy row), as :func:`gumbel_max` reads them, each word's bits as int32. ``temperature``
    is float32."""
    steps = steps or InTrace()
    threshold = keep_threshold(logits, temperature, top_k, top_p, min_p, steps=steps)
    return steps.apply(_rows_of, seed_words, positions, temperature, threshold)


def threshold_of(rows: jax.Array) -> jax.Array:
    """The uint32 thresholds of :func:`sampling_rows`' rows."""
    return lax.bitcast_convert_type(rows[:, 2], jnp.uint32)


def gumbel_max(logits: jax.Array, rows: jax.Array, *, interpret: bool, vocabulary_offset=0, fold: int | None = None,
               block_rows: int | None = None, block_vocabulary: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Step 4 of the contract in one Pallas kernel over (row, vocabulary) blocks: int32 ``(B,)``
    tokens (global indices: the logits' column ``c`` is entry ``vocabulary_offset + c``) and their
    float32 scores, for the rows :func:`sampling_rows` describes. ``fold`` (default:
    :func:`default_fold`) cuts each row into that many parts, rows of the kernel of their own whose
    best tokens combine as shards' do (:func:`best_of_shards`); it and the blocks (``block_rows``,
    ``block_vocabulary``; default per platform) change nothing."""
    batch, vocabulary = logits.shape
    fold = fold or default_fold(batch, vocabulary, interpret)
    width = pl.cdiv(vocabulary, fold)
    starts = np.arange(fold, dtype=np.int32) * width
    parts = jnp.stack([jnp.broadcast_to(starts, (batch, fold)),
                       jnp.broadcast_to(np.clip(vocabulary - starts, 0, width), (batch, fold))], axis=-1)
    rows = jnp.concatenate([jnp.repeat(rows, fold, axis=0), parts.reshape(batch * fold, 2)], axis=1)
    if fold > 1:
        logits = jnp.pad(logits, ((0, 0), (0, fold * width - vocabulary))).reshape(batch * fold, width)
    tokens, scores = _gumbel_max_call(logits, rows, interpret, vocabulary_offset, block_rows, block_vocabulary)
    if fold == 1:
        return tokens, scores
    along_parts = InTrace(along_last_axis)
    scores = scores.reshape(batch, fold)
    return (best_of_shards(tokens.reshape(batch, fold), scores, along_parts)[:, 0],
            along_parts.reduce("max", scores)[:, 0])


def _gumbel_max_call(logits, rows, interpret, vocabulary_offset, block_rows, block_vocabulary):
    """:func:`gumbel_max`'s kernel on rows of logits, each described by six words (four of
    :func:`sampling_rows`, the first column's entry and the columns' count)."""
    batch, vocabulary = logits.shape
    default_rows, default_vocabulary = default_blocks(batch, vocabulary, interpret)
    block_rows = min(block_rows or default_rows, batch)
    block_vocabulary = min(block_vocabulary or default_vocabulary, vocabulary)
    if block_rows != batch and block_rows % tiling.SUBLANES:
        raise ValueError(f"block_rows must be a multiple of {tiling.SUBLANES} or the batch, got {block_rows}")
    if block_vocabulary != vocabulary and block_vocabulary % tiling.LANES:
        raise ValueError(f"block_vocabulary must be a multiple of {tiling.LANES} or the vocabulary, got "
                         f"{block_vocabulary}")
    offset = jnp.asarray(vocabulary_offset, jnp.int32).reshape(1)
    grid = (pl.cdiv(batch, block_rows), pl.cdiv(vocabulary, block_vocabulary))
    kernel = functools.partial(_gumbel_max_kernel, block_vocabulary=block_vocabulary)
    out_spec = pl.BlockSpec((block_rows, 1), lambda i, j: (i, 0))
    call = calls.pallas_call(
        kernel, name=calls.kernel_name("sample_tokens", blocks=(block_rows, block_vocabulary)),
        cost_estimate=calls.cost_estimate(
            bytes_accessed=calls.nbytes(logits, rows) + batch * 8,
            flops=batch * vocabulary * (prng.noise_ops(prng.THREEFRY) + 60)),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((block_rows, rows.shape[1]), lambda i, j: (i, 0)),
                  pl.BlockSpec((block_rows, block_vocabulary), lambda i, j: (i, j))],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, 1), jnp.int32), jax.ShapeDtypeStruct((batch, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret)
    tokens, scores = call(offset, rows, logits)
    return tokens[:, 0], scores[:, 0]


def gumbel_max_of_shard(rows: jax.Array, logits: jax.Array, *, shard_offset: jax.Array, global_shape,
                        shared_over_first_dim: bool, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """:func:`gumbel_max` on one device's shard of logits, as :func:`torch_pallas.bridge.call_sharded`
    runs a noise kernel with ``shared_over_first_dim``: ``shard_offset`` holds the high and low
    words of the shard's first column's index in the vocabulary (``global_shape``, the whole
    logits' shape, is not needed beyond it). int32 and float32 ``(B, 1)``: the shard's best token
    and score, which :func:`best_of_shards` combines along the vocabulary."""
    del global_shape, shared_over_first_dim
    tokens, scores = gumbel_max(logits, rows, interpret=interpret, vocabulary_offset=shard_offset[1])
    return tokens[:, None], scores[:, None]


def along_last_axis(kind: str, x: jax.Array) -> jax.Array:
    """A ``reduce`` (as :class:`InTrace` takes one) of partials laid side by side along the
    last axis, one column per vocabulary shard; the axis is kept, of size 1, so that the result
    and the partials broadcast together."""
    return {"max": jnp.max, "min": jnp.min, "sum": jnp.sum}[kind](x, axis=-1, keepdims=True)


def across(axis_name):
    """A ``reduce`` (as :class:`InTrace` takes one) across the devices of the mesh axis
    ``axis_name`` that splits the vocabulary, inside ``jax.shard_map`` (or ``jax.vmap`` with
    that ``axis_name``)."""
    collectives = {"max": lax.pmax, "min": lax.pmin, "sum": lax.psum}
    return lambda kind, x: collectives[kind](x, axis_name)


def _tied_tokens(tokens, scores, best):
    return jnp.where(scores == best, tokens, np.int32(np.iinfo(np.int32).max))


def best_of_shards(tokens: jax.Array, scores: jax.Array, steps: InTrace) -> jax.Array:
    """The token of the largest score among the vocabulary shards' (``tokens`` and ``scores``,
    their :func:`gumbel_max` results, combined as ``steps`` combines partials), the lowest of
    those tied: the token :func:`gumbel_max` gives the whole row, whose blocks fold in the same way."""
    best = steps.reduce("max", scores)
    return steps.reduce("min", steps.apply(_tied_tokens, tokens, scores, best))


def _drawn_partial(logits, tokens, *, vocabulary_offset):
    columns = lax.broadcasted_iota(jnp.int32, logits.shape, 1) + vocabulary_offset
    return jnp.max(jnp.where(columns == tokens[:, None], _clean(logits), -jnp.inf), axis=-1)


def _exp_sum_partial(logits, largest):
    return jnp.sum(jnp.exp(_clean(logits) - largest[:, None]), axis=-1)


def _logprob_scale(temperature):
    return np.float32(1.0) / jnp.where(_greedy(temperature), np.float32(1.0), temperature)


def _kept_exp_sum_partial(logits, largest, temperature, threshold):
    logits = _clean(logits)
    kept = ordered_key(logits) >= threshold[:, None]
    shifted = (logits - largest[:, None]) * _logprob_scale(temperature)[:, None]
    return jnp.sum(jnp.where(kept, jnp.exp(shifted), np.float32(0.0)), axis=-1)


def _logprobs_of(drawn, largest, exp_sum, kept_exp_sum, temperature):
    drawn = drawn - largest
    raw = drawn - jnp.log(exp_sum)
    processed = jnp.where(_greedy(temperature), np.float32(0.0),
                          drawn * _logprob_scale(temperature) - jnp.log(kept_exp_sum))
    return processed, raw


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array, threshold: jax.Array, *,
                   vocabulary_offset=0, steps: InTrace | None = None) -> tuple[jax.Array, jax.Array]:
    """float32 ``(B,)`` log-probabilities of the drawn ``tokens`` (int32 ``(B,)``, global indices:
    column ``c`` of ``logits`` is entry ``vocabulary_offset + c``): ``(processed, raw)``.

    - ``processed``: under the distribution the token was drawn from, ``softmax(logits / T)``
      over the kept set (``threshold``: :func:`keep_threshold`); a greedy row's (``T < 1e-5``)
      is 0, the log of the probability 1 with which it draws its token. vLLM's
      ``processed_logprobs``, what an RL trainer's importance ratio needs.
    - ``raw``: ``log_softmax(logits)`` at the token, before temperature and filters: vLLM's
      ``raw_logprobs``.

    Values, not decisions: computed with the device's ``exp`` and ``log`` and float sums in the
    compiler's order, so equal across batches, blocks and devices to within float32 rounding,
    not bit for bit (the tokens are). NaN logits count as ``-inf``; a row of ``-inf`` gets NaN,
    as ``torch.log_softmax`` gives. ``steps`` combines partials across vocabulary shards, as
    :func:`keep_threshold`'s. ``temperature`` is float32.
    """
    steps = steps or InTrace()
    largest = steps.reduce("max", steps.apply(_largest_partial, logits))
    drawn = steps.reduce("max", steps.apply(_drawn_partial, logits, tokens, vocabulary_offset=vocabulary_offset))
    exp_sum = steps.reduce("sum", steps.apply(_exp_sum_partial, logits, largest))
    kept_exp_sum = steps.reduce("sum", steps.apply(_kept_exp_sum_partial, logits, largest, temperature, threshold))
    return steps.apply(_logprobs_of, drawn, largest, exp_sum, kept_exp_sum, temperature)


def sample_tokens(logits: jax.Array, seed_words: jax.Array, positions: jax.Array, temperature: jax.Array,
                  top_k: jax.Array | None = None, top_p: jax.Array | None = None, min_p: jax.Array | None = None,
                  *, interpret: bool, with_logprobs: bool = False, vocabulary_offset=0, reduce=None,
                  fold: int | None = None, block_rows: int | None = None, block_vocabulary: int | None = None):
    """int32 ``(B,)`` token ids sampled from ``logits`` (``(B, V)`` float32 or bfloat16), one per
    row, by the contract of this module: row ``b``'s token depends on its logits, its seed's
    words ``seed_words[b]`` (int32 ``(B, 2)``: high, low), ``positions[b]`` (int32) and its
    parameters (``(B,)`` arrays: ``temperature`` float32, 0 greedy; ``top_k`` int32, 0 none;
    ``top_p`` float32, 1 none; ``min_p`` float32, 0 none; ``None``: none for every row) alone.
    ``with_logprobs``: ``(tokens, processed, raw)``, with the tokens' log-probabilities
    (:func:`token_logprobs`).

    Vocabulary-parallel logits (a tensor-parallel ``lm_head``'s, in ``jax.shard_map``): give each
    device its shard's columns, their first column's index in the vocabulary
    (``vocabulary_offset``) and ``reduce=across(axis_name)`` for the mesh axis splitting them; every
    device then returns the tokens of the whole rows, with no gather of the logits (a reduction of
    a few ``(B,)`` partials per threshold step, and one of the shards' best tokens).

    The pure-JAX entry point: arguments are not checked here (the torch op checks them).
    """
    steps = InTrace(reduce)
    temperature = temperature.astype(jnp.float32)
    rows = sampling_rows(logits, seed_words, positions, temperature, top_k, top_p, min_p, steps=steps)
    tokens, scores = gumbel_max(logits, rows, interpret=interpret, vocabulary_offset=vocabulary_offset, fold=fold,
                                block_rows=block_rows, block_vocabulary=block_vocabulary)
    if reduce is not None:
        tokens = best_of_shards(tokens, scores, steps)
    if not with_logprobs:
        return tokens
    return (tokens, *token_logprobs(logits, tokens, temperature, threshold_of(rows),
                                    vocabulary_offset=vocabulary_offset, steps=steps))
