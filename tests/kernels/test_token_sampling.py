"""The token sampler (torch_pallas.kernels.token_sampling) against its contract: each row's key
from an independent Threefry-2x32-20 written from Random123, its noise ``jax.random.bits`` of that
key, its kept set by the definitions computed in float64, its token the same whatever the batch,
slot, padding rows and blocks (random configurations), its tokens distributed as the processed
distribution (chi-square), greedy rows ``argmax``'s, their log-probabilities those of float64."""

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.scipy.special import gammaincc

from reference import SEEDS, kept_by_definition, numpy_threefry2x32
from torch_pallas.kernels import token_sampling

# The seed mix's fixed key as docs/sampling.md states it.
SEED_MIX = (0x9E3779B9, 0x243F6A88)

sample = jax.jit(token_sampling.sample_tokens,
                 static_argnames=("interpret", "with_logprobs", "fold", "block_rows", "block_vocabulary"))
keep_threshold = jax.jit(token_sampling.keep_threshold)


def seed_words(seeds) -> np.ndarray:
    return np.array([[seed >> 32, seed & 0xFFFFFFFF] for seed in seeds], np.uint32).view(np.int32)


def reference_row_key(seed: int, position: int) -> tuple[int, int]:
    mixed = numpy_threefry2x32(SEED_MIX, [seed >> 32], [seed & 0xFFFFFFFF], rounds=20)
    key = numpy_threefry2x32([int(word[0]) for word in mixed], [0], [position], rounds=20)
    return int(key[0][0]), int(key[1][0])


def test_row_keys_are_two_threefry_20_mixes_of_the_seed_and_position():
    positions = [0, 1, 2**31, 2**32 - 1]
    seeds = [seed for seed in SEEDS for _ in positions]
    k0, k1 = jax.jit(token_sampling.row_key_words)(seed_words(seeds), np.array(positions * len(SEEDS), np.uint32))
    want = [reference_row_key(seed, position) for seed, position in zip(seeds, positions * len(SEEDS))]
    assert list(zip(np.asarray(k0).tolist(), np.asarray(k1).tolist())) == want


def reference_tokens(logits, seeds, positions, temperature, threshold):
    """argmax over the kept set of logit + T * Gumbel(jax.random.bits(row key, (V,))), per row."""
    tokens = []
    for row, seed, position, t, least in zip(np.asarray(logits, np.float32), seeds, positions, temperature, threshold):
        key = jax.random.wrap_key_data(np.array(reference_row_key(seed, position), np.uint32))
        gumbel = np.asarray(jax.jit(token_sampling.gumbel_from_bits)(jax.random.bits(key, row.shape, jnp.uint32)))
        kept = np.asarray(token_sampling.ordered_key(row)) >= least
        tokens.append(int(np.argmax(np.where(kept, row + np.float32(t) * gumbel, -np.inf))))
    return tokens


def random_rows(rng, batch, vocabulary, *, greedy_share=0.2):
    """Logits and per-row parameters: every parameter on in some rows and off in others."""
    logits = (rng.standard_normal((batch, vocabulary)) * rng.uniform(0.5, 4, (batch, 1))).astype(np.float32)
    temperature = np.where(rng.random(batch) < greedy_share, 0.0, rng.uniform(0.2, 2.0, batch)).astype(np.float32)
    top_k = np.where(rng.random(batch) < 0.5, 0, rng.integers(1, vocabulary + 2, batch)).astype(np.int32)
    top_p = np.where(rng.random(batch) < 0.5, 1.0, rng.uniform(0.05, 1.0, batch)).astype(np.float32)
    min_p = np.where(rng.random(batch) < 0.5, 0.0, rng.uniform(0.0, 0.5, batch)).astype(np.float32)
    seeds = [int(s) for s in rng.integers(0, 2**63, batch, dtype=np.uint64) * 2 + rng.integers(0, 2, batch,
                                                                                                 dtype=np.uint64)]
    positions = rng.integers(0, 2**32, batch, dtype=np.uint64).astype(np.uint32)
    return dict(logits=logits, seeds=seeds, positions=positions, temperature=temperature, top_k=top_k, top_p=top_p,
                min_p=min_p)


def call(rows, **blocks):
    return np.asarray(sample(rows["logits"], seed_words(rows["seeds"]), rows["positions"], rows["temperature"],
                             rows["top_k"], rows["top_p"], rows["min_p"], interpret=True, **blocks))


def test_tokens_are_the_kept_sets_best_logit_plus_temperature_times_gumbel_noise():
    rows = random_rows(np.random.default_rng(0), 12, 300)
    threshold = keep_threshold(rows["logits"], rows["temperature"], rows["top_k"], rows["top_p"], rows["min_p"])
    want = reference_tokens(rows["logits"], rows["seeds"], rows["positions"], rows["temperature"], np.asarray(threshold))
    assert call(rows).tolist() == want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kept_sets_follow_the_definitions(dtype):
    """bfloat16 logits' thresholds are searched over their keys' top 16 bits: the same sets."""
    rng = np.random.default_rng(1)
    rows = random_rows(rng, 64, 257, greedy_share=0.1)
    # Ties at thresholds: rows of a few distinct values.
    rows["logits"][:8] = np.round(rows["logits"][:8])
    logits = jnp.asarray(rows["logits"], dtype)
    rows["logits"] = np.asarray(logits.astype(jnp.float32))
    threshold = np.asarray(keep_threshold(logits, rows["temperature"], rows["top_k"], rows["top_p"], rows["min_p"]))
    keys = np.asarray(token_sampling.ordered_key(rows["logits"]))
    for b in range(64):
        want = kept_by_definition(rows["logits"][b], rows["temperature"][b], rows["top_k"][b], rows["top_p"][b],
                                  rows["min_p"][b])
        got = keys[b] >= threshold[b]
        assert np.array_equal(got, want), (b, {name: rows[name][b] for name in ("temperature", "top_k", "top_p",
                                                                                  "min_p")}, got.sum(), want.sum())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_top_p_over_a_long_tail_and_signed_zeros_follows_the_definition(dtype):
    """A language model's vocabulary: tens of thousands of tokens in the tail, whose masses the
    top-p sums must not round away (each floored to 2**-24 of the largest's, they moved the
    nucleus in one row in ten); logits in halves, whose ties include -0.0 and 0.0 (one value)."""
    rng = np.random.default_rng(7)
    batch, vocabulary = 48, 32000
    logits = rng.standard_normal((batch, vocabulary)) * rng.uniform(1, 4, (batch, 1))
    logits[:, :20] += rng.uniform(0, 8, (batch, 20))
    logits[batch // 2:] = np.round(logits[batch // 2:] * 2) / 2
    given = jnp.asarray(logits, dtype)
    logits = np.asarray(given.astype(jnp.float32))
    assert np.signbit(logits[batch // 2:][logits[batch // 2:] == 0]).any()
    temperature = rng.uniform(0.3, 1.5, batch).astype(np.float32)
    top_p = rng.choice([0.5, 0.9, 0.95, 0.99], batch).astype(np.float32)
    threshold = np.asarray(keep_threshold(given, temperature, None, top_p, None))
    keys = np.asarray(token_sampling.ordered_key(logits))
    for b in range(batch):
        want = kept_by_definition(logits[b], temperature[b], 0, top_p[b], 0.0)
        assert np.array_equal(keys[b] >= threshold[b], want), (b, (keys[b] >= threshold[b]).sum(), want.sum())


# Vocabularies and dtypes, batch sizes and blocks the invariance test combines: few shapes (each
# compiles once), many rows. Blocks: the default, ragged vocabulary blocks, several row blocks, rows
# folded into parts (as a TPU folds a batch below 8 rows).
VOCABULARIES = {"fast": [1000], "slow": [1000, 2048 + 5, 128]}
BATCHES = {"fast": [1, 13], "slow": [1, 8, 13, 32]}
BLOCKS = {"fast": [{}, dict(block_rows=8, block_vocabulary=256), dict(fold=4)],
          "slow": [{}, dict(block_rows=8, block_vocabulary=128), dict(block_rows=16, block_vocabulary=384),
                   dict(fold=3, block_vocabulary=128), dict(fold=8)]}


@pytest.mark.parametrize("tier", ["fast", pytest.param("slow", marks=pytest.mark.slow)])
def test_a_rows_token_is_the_same_whatever_its_batch_slot_padding_and_blocks(tier):
    """Row b's token alone (a batch of one, default blocks) equals its token in random batches:
    other rows, padding rows (zeros at temperature -1, as vLLM pads), any slot, any blocks."""
    rng = np.random.default_rng(2)
    configurations = 200 if tier == "fast" else 1000
    pools = {(vocabulary, dtype): random_rows(rng, 40, vocabulary)
             for vocabulary in VOCABULARIES[tier] for dtype in (jnp.float32, jnp.bfloat16)}
    alone = {}
    checked = 0
    for _ in range(configurations):
        (vocabulary, dtype), pool = list(pools.items())[rng.integers(len(pools))]
        batch = BATCHES[tier][rng.integers(len(BATCHES[tier]))]
        blocks = BLOCKS[tier][rng.integers(len(BLOCKS[tier]))]
        picked = rng.choice(40, batch, replace=False) if batch <= 40 else rng.integers(0, 40, batch)
        padding = rng.random(batch) < 0.2
        rows = {name: [value[i] for i in picked] if name == "seeds" else np.asarray(value)[picked].copy()
                for name, value in pool.items()}
        rows["logits"][padding] = 0
        rows["temperature"][padding] = -1
        rows["logits"] = jnp.asarray(rows["logits"], dtype)
        tokens = call(rows, **blocks)
        for slot, row in enumerate(picked):
            if padding[slot]:
                continue
            if (vocabulary, dtype, row) not in alone:
                single = {name: [value[row]] if name == "seeds" else np.asarray(value)[row:row + 1]
                          for name, value in pool.items()}
                single["logits"] = jnp.asarray(single["logits"], dtype)
                alone[vocabulary, dtype, row] = int(call(single)[0])
            assert tokens[slot] == alone[vocabulary, dtype, row], (vocabulary, dtype, batch, blocks, slot, row)
            checked += 1
    assert checked >= configurations


def test_logprobs_are_the_drawn_tokens_under_the_processed_and_the_raw_distribution():
    """Against float64: log softmax(logits / T) over the kept set (0 for greedy rows) and log
    softmax(logits) at the token; equal across blocks to within float32 rounding."""
    rows = random_rows(np.random.default_rng(5), 24, 300, greedy_share=0.2)
    arguments = (rows["logits"], seed_words(rows["seeds"]), rows["positions"], rows["temperature"], rows["top_k"],
                 rows["top_p"], rows["min_p"])
    tokens, processed, raw = map(np.asarray, sample(*arguments, interpret=True, with_logprobs=True))
    assert tokens.tolist() == call(rows).tolist()
    for b in range(24):
        logits, temperature = rows["logits"][b].astype(np.float64), float(rows["temperature"][b])
        kept = kept_by_definition(rows["logits"][b], temperature, rows["top_k"][b], rows["top_p"][b], rows["min_p"][b])
        assert kept[tokens[b]]
        want_raw = logits[tokens[b]] - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        if temperature < 1e-5:
            want_processed = 0.0
        else:
            scaled = np.where(kept, (logits - logits.max()) / temperature, -np.inf)
            want_processed = scaled[tokens[b]] - np.log(np.exp(scaled).sum())
        assert raw[b] == pytest.approx(want_raw, abs=1e-5) and processed[b] == pytest.approx(want_processed, abs=1e-5)
    blocked = sample(*arguments, interpret=True, with_logprobs=True, block_rows=8, block_vocabulary=128)
    assert np.asarray(blocked[0]).tolist() == tokens.tolist()
    np.testing.assert_allclose(np.asarray(blocked[1]), processed, atol=1e-6)
    np.testing.assert_allclose(np.asarray(blocked[2]), raw, atol=1e-6)


@pytest.mark.parametrize("shards", [2, 5])
def test_vocabulary_parallel_shards_sample_the_whole_rows_tokens(shards):
    """Each shard of the vocabulary (its columns, their offset, reductions across the shards:
    ``jax.vmap`` with an axis name stands in for ``jax.shard_map``'s devices) returns the whole
    rows' tokens, and their log-probabilities to within float32 rounding."""
    rows = random_rows(np.random.default_rng(6), 16, 1000, greedy_share=0.2)
    rows["logits"][:4] = np.round(rows["logits"][:4])  # ties across shards
    parameters = (seed_words(rows["seeds"]), rows["positions"], rows["temperature"], rows["top_k"], rows["top_p"],
                  rows["min_p"])
    tokens, processed, raw = map(np.asarray, sample(rows["logits"], *parameters, interpret=True, with_logprobs=True))
    width = 1000 // shards
    columns = jnp.asarray(rows["logits"].reshape(16, shards, width).transpose(1, 0, 2))

    def on_shard(logits, offset):
        return token_sampling.sample_tokens(logits, *parameters, interpret=True, with_logprobs=True,
                                            vocabulary_offset=offset, reduce=token_sampling.across("vocabulary"))
    got = jax.jit(jax.vmap(on_shard, axis_name="vocabulary"))(columns, jnp.arange(shards, dtype=jnp.int32) * width)
    for shard in range(shards):
        assert np.asarray(got[0][shard]).tolist() == tokens.tolist()
        np.testing.assert_allclose(np.asarray(got[1][shard]), processed, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got[2][shard]), raw, atol=1e-5)


LOGITS = np.array([2.0, 1.0, 0.5, 0.5, -1.0, -3.0], np.float32)
DRAWS = 100_000
# (temperature, top_k, top_p, min_p): each parameter alone and all of them together.
PROCESSED = [(1.0, 0, 1.0, 0.0), (0.5, 3, 1.0, 0.0), (1.5, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.3), (0.7, 4, 0.9, 0.05)]


def chi_square_p_value(counts, probabilities) -> float:
    kept = probabilities > 0
    assert counts[~kept].sum() == 0, "a token outside the kept set was drawn"
    expected = probabilities[kept] * counts.sum()
    statistic = ((counts[kept] - expected) ** 2 / expected).sum()
    return float(gammaincc((kept.sum() - 1) / 2, statistic / 2)) if kept.sum() > 1 else 1.0


@pytest.mark.parametrize("draws_over", ["positions", "seeds"])
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", PROCESSED)
def test_tokens_follow_the_processed_distribution(temperature, top_k, top_p, min_p, draws_over):
    """10**5 draws of one row's token, over a request's positions 0, 1, ... (one seed) or over
    seeds s, s + 1, ... (one position): their counts against the processed distribution."""
    kept = kept_by_definition(LOGITS, temperature, top_k, top_p, min_p)
    probabilities = np.where(kept, np.exp(LOGITS.astype(np.float64) / temperature), 0.0)
    probabilities /= probabilities.sum()
    base = 2**40 + 12345
    seeds = [base] * DRAWS if draws_over == "positions" else [base + i for i in range(DRAWS)]
    positions = np.arange(DRAWS, dtype=np.uint32) if draws_over == "positions" else np.full(DRAWS, 7, np.uint32)

    def full(value, dtype):
        return np.full(DRAWS, value, dtype)
    tokens = sample(np.broadcast_to(LOGITS, (DRAWS, LOGITS.size)), seed_words(seeds), positions,
                    full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                    full(min_p, np.float32), interpret=True)
    counts = np.bincount(np.asarray(tokens), minlength=LOGITS.size)
    assert chi_square_p_value(counts, probabilities) > 1e-3, (counts, probabilities * DRAWS)


def test_greedy_rows_are_argmax_with_ties_to_the_lowest_index():
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal((16, 300)) * 2).astype(np.float32)  # ties at the top
    temperature = np.array([0.0, 1e-6, -1.0, 9.9e-6] * 4, np.float32)
    tokens = sample(logits, seed_words(range(16)), np.arange(16, dtype=np.uint32), temperature,
                    np.full(16, 5, np.int32), np.full(16, 0.5, np.float32), None, interpret=True,
                    block_rows=8, block_vocabulary=128)
    assert np.asarray(tokens).tolist() == np.argmax(logits, axis=1).tolist()
    signed_zeros = np.array([[-1.0, -0.0, 0.0, -2.0], [0.0, -0.0, -0.0, -3.0]], np.float32)
    tokens = sample(signed_zeros, seed_words([1, 2]), np.zeros(2, np.uint32), np.zeros(2, np.float32),
                    interpret=True)
    assert np.asarray(tokens).tolist() == [1, 0]  # torch.argmax's: -0.0 == 0.0


def test_rows_of_minus_infinity_and_nan():
    """A row of -inf draws index 0 (nothing to choose from); NaN logits are never drawn."""
    logits = np.zeros((3, 200), np.float32)
    logits[0] = -np.inf
    logits[1, ::2] = np.nan
    logits[2, :150] = np.nan
    tokens = np.asarray(sample(logits, seed_words([1, 2, 3]), np.zeros(3, np.uint32), np.ones(3, np.float32),
                               None, np.full(3, 0.9, np.float32), None, interpret=True))
    assert tokens[0] == 0 and tokens[1] % 2 == 1 and tokens[2] >= 150


def test_blocks_that_mosaic_would_refuse_are_refused():
    logits = np.zeros((13, 1000), np.float32)
    arguments = (seed_words([0] * 13), np.zeros(13, np.uint32), np.ones(13, np.float32))
    with pytest.raises(ValueError, match="block_vocabulary must be a multiple of 128"):
        token_sampling.sample_tokens(logits, *arguments, interpret=True, block_vocabulary=200)
    with pytest.raises(ValueError, match="block_rows must be a multiple of 8"):
        token_sampling.sample_tokens(logits, *arguments, interpret=True, block_rows=5)


def test_portable_log_and_exp_are_within_an_ulp():
    x = np.random.default_rng(4).uniform(2**-24, 20, 100_000).astype(np.float32)
    for function, values, want in ((token_sampling.portable_log, x, np.log(x.astype(np.float64))),
                                   (token_sampling.portable_exp, -x * 4, np.exp(-x.astype(np.float64) * 4))):
        got = np.asarray(jax.jit(function)(values)).astype(np.float64)
        assert np.max(np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32))) <= 1.0
    assert float(token_sampling.portable_exp(np.float32(0))) == 1.0
    assert float(token_sampling.portable_exp(np.float32(-np.inf))) == 0.0
