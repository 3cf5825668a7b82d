"""Candidate mask generators for the free-noise issue, as libtpu schedules them: VALU ops per
element of a bfloat16 dropout kernel whose keep test is a 16-bit (or 8-bit) uniform, beside the
shipped impls.

    .venv/xla/bin/python bench/tpu_cost_noise_candidates.py    # libtpu 0.0.21: v4, v5e, v5p, v6e
    LIBTPU_INIT_ARGS=--xla_jf_dump_to=$(mktemp -d) .venv/torchax/bin/python bench/tpu_cost_noise_candidates.py \
        --newest-libtpu                                          # libtpu 0.0.52: v6e and TPU7x

Each candidate is one elementwise Pallas kernel over (512, 1024) blocks of a (4096, 1024) bfloat16
tensor (the 2-D view ``bench/tpu_cost.py`` uses): ``where(bits < threshold, x * scale, 0)``, with
``bits`` 16 bits drawn from the element's flat index and the 8-byte key, compiled for TPU and read
off libtpu's final bundles (``tpu_cost.measure``: the static schedule). The candidates:

- **threefry-20, a word per element**: ``prng.threefry_bits`` (the sampler's and ``impl="threefry"``'s
  hash), its low 16 bits.
- **threefry-20, two elements per word**: the same hash of the top half of the block's rows,
  its high and low 16 bits the keep tests of a row and the row half a block below.
- **multiply-xorshift, two elements per word**: two rounds of a 32-bit multiply-xorshift
  (``lowbias32``'s constants, skeeto/hash-prospector), keyed by xoring the key's words in before
  each, on the same layout.
- **threefry-13, four 16-bit tests per hash**: the tiled impl's hash (both words, four tests),
  written as a candidate, beside the shipped kernel: what the candidates' layout costs.
- **8-bit keep tests** (FlashAttention-2's resolution: ``p`` in steps of 1/256): the same hashes
  filling twice the elements, threefry-13 eight per hash and multiply-xorshift four per word,
  each test the word shifted (but the first) and compared; and the shipped tiled kernel drawing
  8-bit uniforms (``prng.tiled_slabs``' eight parts per hash), its tiles walked as the shipped
  16-bit kernel walks them.

The ``tiled`` and ``hardware`` rows are the shipped dropout kernels (``dropout.dropout``). Nothing
here says a candidate's statistics are sound (the batteries in ``bench/noise_batteries`` would);
this is their cost. Then flash attention's forward+backward with the tiled impl's dropout on 16-bit
and on 8-bit keep tests, beside none (v5e, v5p, v6e). Written to
``results/tpu_cost_noise_candidates.{json,md}``.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import common
import tpu_cost_attention
from tpu_cost import KEY, N, VIEW, grid_size, measure
from torch_pallas import tpu_schedule
from torch_pallas.kernels import dropout, elementwise, prng

GENERATIONS = ("v4", "v5e", "v5p", "v6e")
BLOCK_ROWS = 512
THRESHOLD = np.uint32(int(0.9 * 2**16))  # keep 90 %
SCALE = np.float32(1 / 0.9)
# lowbias32 (skeeto/hash-prospector): x ^= x >> 16; x *= M1; x ^= x >> 15; x *= M2; x ^= x >> 16.
M1, M2 = np.uint32(0x7FEB352D), np.uint32(0x846CA68B)


def lowbias32(x):
    x = x ^ (x >> np.uint32(16))
    x = x * M1
    x = x ^ (x >> np.uint32(15))
    x = x * M2
    return x ^ (x >> np.uint32(16))


def counters(shape, row0):
    rows = lax.broadcasted_iota(jnp.uint32, shape, 0) + lax.convert_element_type(row0, jnp.uint32)
    return rows * np.uint32(VIEW[1]) + lax.broadcasted_iota(jnp.uint32, shape, 1)


def threefry_20_word(k0, k1, index):
    return (prng.threefry_bits(k0, k1, index),)


def threefry_13_words(k0, k1, index):
    """The tiled impl's hash (Threefry-2x32-13, counter (0, index)): both output words."""
    return prng.threefry2x32(k0, k1, jnp.zeros_like(index), index, rounds=prng.TILED_ROUNDS)


def multiply_xorshift_pair(k0, k1, index):
    return (lowbias32(lowbias32(index ^ k0) ^ k1),)


def kernel(key_ref, x_ref, out_ref, *, bits_of, tests_per_word, test_bits):
    """``where(keep, x * scale, 0)`` over a block: ``bits_of`` gives words of a hash grid with
    ``rows / (words * tests_per_word)`` rows, each word ``tests_per_word`` keep tests of
    ``test_bits`` bits (its top bits, then the next after a shift), filling slabs of rows in order."""
    k0 = lax.convert_element_type(key_ref[0], jnp.uint32)  # the same bits (a scalar: no bitcast in Mosaic)
    k1 = lax.convert_element_type(key_ref[1], jnp.uint32)
    row0 = pl.program_id(0) * BLOCK_ROWS
    x = x_ref[...].astype(jnp.float32)
    words_per_hash = len(bits_of(k0, k1, counters((8, 128), row0)))
    slab = x.shape[0] // (words_per_hash * tests_per_word)
    words = bits_of(k0, k1, counters((slab, x.shape[1]), row0))
    threshold = np.uint32(int(0.9 * 2**test_bits) << (32 - test_bits))
    if tests_per_word == 1 and test_bits == 16:
        keep = [(words[0] & np.uint32(0xFFFF)) < np.uint32(int(0.9 * 2**16))]  # the low half, as before
    else:
        keep = [(word << np.uint32(test_bits * part) if part else word) < threshold
                for word in words for part in range(tests_per_word)]
    keep = jnp.concatenate(keep) if len(keep) > 1 else keep[0]
    scale = np.float32(2**test_bits / int(0.9 * 2**test_bits))
    out_ref[...] = jnp.where(keep, x * scale, 0.0).astype(out_ref.dtype)


def candidate(bits_of, tests_per_word, test_bits=16):
    def function(key, x):
        return pl.pallas_call(
            functools.partial(kernel, bits_of=bits_of, tests_per_word=tests_per_word, test_bits=test_bits),
            grid=(VIEW[0] // BLOCK_ROWS,),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec((BLOCK_ROWS, VIEW[1]), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((BLOCK_ROWS, VIEW[1]), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(key, x)
    return function


def tiled_8_bit_tests(key, x):
    """The shipped tiled kernel (``elementwise.noise_map``: its tiles walked in pieces) drawing 8-bit
    uniforms, eight per hash, the keep test ``bits >= t << 24``."""
    threshold = np.uint32(int(0.1 * 2**8 + 0.5) << 24)
    keep_probability = np.float32(1 - int(0.1 * 2**8 + 0.5) / 2**8)

    def transform(bits, values):
        return dropout.kept_values(bits >= threshold, values, keep_probability).astype(values.dtype)
    return elementwise.noise_map(key, x.shape, transform, x.dtype, (x,), impl="tiled", interpret=False,
                                 name="dropout", uniform_bits=8)


def shipped(impl):
    return lambda key, x: dropout.dropout(key, x, p=0.1, impl=impl, interpret=False)


CANDIDATES = {
    "threefry-20, a word per element": candidate(threefry_20_word, 1),
    "threefry-20, two elements per word": candidate(threefry_20_word, 2),
    "multiply-xorshift x2, two elements per word": candidate(multiply_xorshift_pair, 2),
    "threefry-13, four 16-bit tests per hash (tiled's, as a candidate)": candidate(threefry_13_words, 2),
    "threefry-13, eight 8-bit tests per hash": candidate(threefry_13_words, 4, test_bits=8),
    "multiply-xorshift x2, four 8-bit tests per word": candidate(multiply_xorshift_pair, 4, test_bits=8),
    "tiled (shipped default)": shipped("tiled"),
    "tiled's kernel, eight 8-bit tests per hash": tiled_8_bit_tests,
    "hardware (shipped)": shipped("hardware"),
}


# Flash attention forward+backward, non-causal, bfloat16, as bench/tpu_cost_attention.py compiles it.
ATTENTION_SHAPES = {"(2, 8, 2048, 64)": (2, 8, 2048, 64), "ViT-B/16's (32, 12, 197, 64)": (32, 12, 197, 64)}
ATTENTION_GENERATIONS = ("v5e", "v5p", "v6e")


@contextlib.contextmanager
def keep_tests_of(bits: int):
    """Every kernel traced inside draws the tiled impl's keep tests with ``bits`` bits: the kernels
    read ``prng.DROPOUT_BITS`` when they are traced, set here for the compile (and ``p`` rounds to
    a multiple of ``2**-bits``, the kept values scaled by the keep probability that gives)."""
    saved, prng.DROPOUT_BITS = prng.DROPOUT_BITS, bits
    try:
        yield
    finally:
        prng.DROPOUT_BITS = saved


def attention_rows() -> list[dict]:
    """The whole program's bundles (tpu_cost_attention.measure) of attention without dropout and with
    the tiled impl's dropout (p = 0.1) on 16-bit and 8-bit keep tests."""
    rows = []
    for shape_name, shape in ATTENTION_SHAPES.items():
        for generation in ATTENTION_GENERATIONS:
            bundles = {}
            for label, program, bits in (("none", "ours p=0", prng.DROPOUT_BITS), ("16", "ours p=0.1 tiled", 16),
                                         ("8", "ours p=0.1 tiled", 8)):
                with keep_tests_of(bits):
                    function, args = tpu_cost_attention.jax_program(program, shape, False, True)
                    compiled = tpu_cost_attention.measure(
                        lambda: tpu_cost_attention._compile_jax(function, args, generation), generation)
                bundles[label] = compiled["bundles"]
            rows.append(dict(shape=shape_name, generation=generation, bundles=bundles,
                             over_none_16=bundles["16"] / bundles["none"], over_none_8=bundles["8"] / bundles["none"]))
    return rows


def candidate_rows(candidates, generations) -> list[dict]:
    """Each candidate's schedule per generation (``/ HBM time`` None where the clock is unpublished)."""
    x = jax.ShapeDtypeStruct(VIEW, jnp.bfloat16)
    rows = []
    for name in candidates:
        function = CANDIDATES[name]
        grid = grid_size(function, (KEY, x))
        for generation in generations:
            result = measure(function, (KEY, x), generation)
            # As bench/tpu_cost.py counts: a vector op acts on 8 x 128 32-bit lanes, and a megacore's two
            # TensorCores each run half the grid.
            cores = grid // result["grid_steps"] if result["grid_steps"] else 1
            hardware = tpu_schedule.HARDWARE[generation]
            # One TensorCore's bundles at the clock, beside the chip's HBM time of reading and writing
            # the tensor once (2 bytes each way per element).
            over_hbm_time = (result["bundles"] / hardware.clock / (4 * N / hardware.hbm_bandwidth)
                             if hardware.clock else None)
            rows.append(dict(candidate=name, generation=generation,
                             valu_ops_per_element=result["valu_ops"] * 1024 / (N / cores),
                             bundles_per_vreg=result["bundles"] * 1024 / (N / cores), over_hbm_time=over_hbm_time))
    return rows


def candidates_table(rows) -> str:
    return common.markdown_table(
        ["candidate", "TPU", "VALU ops per element", "bundles per 1024 elements", "/ HBM time"],
        [(r["candidate"], r["generation"], r["valu_ops_per_element"], r["bundles_per_vreg"],
          "—" if r["over_hbm_time"] is None else r["over_hbm_time"]) for r in rows])


# The newest libtpu (the torchax stack's 0.0.52) knows TPU7x: the shipped kernels and the 8-bit tiled one there,
# beside v6e under the same libtpu.
NEWEST_CANDIDATES = ("tiled (shipped default)", "tiled's kernel, eight 8-bit tests per hash", "hardware (shipped)")
NEWEST_GENERATIONS = ("v6e", "tpu7x")


def main_on_the_newest_libtpu() -> None:
    rows = candidate_rows(NEWEST_CANDIDATES, NEWEST_GENERATIONS)
    notes = ("\nThe shipped kernels and the 8-bit tiled one of tpu_cost_noise_candidates.md (bfloat16, 2**22 "
             "elements, libtpu's static schedule), compiled by libtpu 0.0.52, the torchax stack's, which knows TPU7x "
             "(run with LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR set before the process starts: there "
             "enable_estimates() after importing JAX leaves no dump). TPU7x's clock is unpublished: no time.\n")
    common.write("tpu_cost_noise_candidates_tpu7x", dict(mode="compile-only", rows=rows), candidates_table(rows) + notes,
                 None)
    print(candidates_table(rows) + notes)


def main() -> None:
    if "--newest-libtpu" in sys.argv:
        return main_on_the_newest_libtpu()
    rows = candidate_rows(CANDIDATES, GENERATIONS)
    table = candidates_table(rows)
    notes = ("\nbfloat16, 2**22 elements, keep probability 0.9 tested on 16 bits (8 where a row says so); "
             "libtpu's static schedule (bench/tpu_cost.py's measure), compile only. A candidate's VALU ops "
             "include the load, scale, select and store every dropout kernel has (the hardware row is close to "
             "that floor). / HBM time: one TensorCore's bundles at its clock (a megacore's two run half the grid "
             "each) over the time of reading and writing the tensor at the chip's HBM bandwidth "
             "(torch_pallas.tpu_schedule.HARDWARE).\n")
    attention = attention_rows()
    attention_table = common.markdown_table(
        ["attention fwd+bwd", "TPU", "no dropout (bundles)", "16-bit tests / none", "8-bit tests / none"],
        [(r["shape"], r["generation"], r["bundles"]["none"], r["over_none_16"], r["over_none_8"]) for r in attention])
    attention_notes = ("\nFlash attention forward and backward (bench/tpu_cost_attention.py's program: the forward "
                       "kernel, both backward kernels and XLA's ops around them), non-causal, bfloat16, with the "
                       "tiled impl's dropout at p = 0.1 on 16-bit keep tests (shipped) and on 8-bit ones "
                       "(keep_tests_of: the same kernels traced with prng.DROPOUT_BITS = 8), beside no dropout; "
                       "the whole program's bundles, libtpu's schedule.\n")
    markdown = table + notes + "\n" + attention_table + attention_notes
    common.write("tpu_cost_noise_candidates", dict(mode="compile-only", rows=rows, attention=attention), markdown,
                 None)
    print(markdown)


if __name__ == "__main__":
    main()
