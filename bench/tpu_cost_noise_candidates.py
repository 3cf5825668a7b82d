"""Candidate mask generators for the free-noise issue, as libtpu schedules them: VALU ops per
element of a bfloat16 dropout kernel whose keep test is a 16-bit uniform, beside the shipped impls.

    .venv/xla/bin/python bench/tpu_cost_noise_candidates.py    # libtpu 0.0.21: v4, v5e, v5p, v6e

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

The ``tiled`` and ``hardware`` rows are the shipped dropout kernels (``dropout.dropout``). Nothing
here says a candidate's statistics are sound (the batteries in ``bench/noise_batteries`` would);
this is their cost. Written to ``results/tpu_cost_noise_candidates.{json,md}``.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import common
from tpu_cost import KEY, N, VIEW, grid_size, measure
from torch_pallas.kernels import dropout, prng

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


def threefry_word_per_element(k0, k1, index):
    return prng.threefry_bits(k0, k1, index) & np.uint32(0xFFFF)


def threefry_pair(k0, k1, index):
    return prng.threefry_bits(k0, k1, index)


def multiply_xorshift_pair(k0, k1, index):
    return lowbias32(lowbias32(index ^ k0) ^ k1)


def kernel(key_ref, x_ref, out_ref, *, bits_of, pairs):
    k0 = lax.convert_element_type(key_ref[0], jnp.uint32)  # the same bits (a scalar: no bitcast in Mosaic)
    k1 = lax.convert_element_type(key_ref[1], jnp.uint32)
    row0 = pl.program_id(0) * BLOCK_ROWS
    x = x_ref[...].astype(jnp.float32)
    if not pairs:
        keep = bits_of(k0, k1, counters(x.shape, row0)) < THRESHOLD
    else:
        half = x.shape[0] // 2
        words = bits_of(k0, k1, counters((half, x.shape[1]), row0))
        keep = jnp.concatenate([(words >> np.uint32(16)) < THRESHOLD, (words & np.uint32(0xFFFF)) < THRESHOLD])
    out_ref[...] = jnp.where(keep, x * SCALE, 0.0).astype(out_ref.dtype)


def candidate(bits_of, pairs):
    def function(key, x):
        return pl.pallas_call(
            functools.partial(kernel, bits_of=bits_of, pairs=pairs), grid=(VIEW[0] // BLOCK_ROWS,),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec((BLOCK_ROWS, VIEW[1]), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((BLOCK_ROWS, VIEW[1]), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(key, x)
    return function


def shipped(impl):
    return lambda key, x: dropout.dropout(key, x, p=0.1, impl=impl, interpret=False)


CANDIDATES = {
    "threefry-20, a word per element": candidate(threefry_word_per_element, pairs=False),
    "threefry-20, two elements per word": candidate(threefry_pair, pairs=True),
    "multiply-xorshift x2, two elements per word": candidate(multiply_xorshift_pair, pairs=True),
    "tiled (shipped default)": shipped("tiled"),
    "hardware (shipped)": shipped("hardware"),
}


def main() -> None:
    x = jax.ShapeDtypeStruct(VIEW, jnp.bfloat16)
    rows = []
    for name, function in CANDIDATES.items():
        grid = grid_size(function, (KEY, x))
        for generation in GENERATIONS:
            result = measure(function, (KEY, x), generation)
            # As bench/tpu_cost.py counts: a vector op acts on 8 x 128 32-bit lanes, and a megacore's two
            # TensorCores each run half the grid.
            cores = grid // result["grid_steps"] if result["grid_steps"] else 1
            rows.append(dict(candidate=name, generation=generation,
                             valu_ops_per_element=result["valu_ops"] * 1024 / (N / cores),
                             bundles_per_vreg=result["bundles"] * 1024 / (N / cores)))
    table = common.markdown_table(
        ["candidate", "TPU", "VALU ops per element", "bundles per 1024 elements"],
        [(r["candidate"], r["generation"], r["valu_ops_per_element"], r["bundles_per_vreg"]) for r in rows])
    notes = ("\nbfloat16, 2**22 elements, keep probability 0.9 tested on 16 bits; libtpu's static schedule "
             "(bench/tpu_cost.py's measure), compile only. A candidate's VALU ops include the load, scale, "
             "select and store every dropout kernel has (the hardware row is close to that floor).\n")
    common.write("tpu_cost_noise_candidates", dict(mode="compile-only", rows=rows), table + notes, None)
    print(table + notes)


if __name__ == "__main__":
    main()
