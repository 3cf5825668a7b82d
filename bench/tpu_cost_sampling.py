"""torch_pallas.sample_tokens on the TPU compiler, side by side with the samplers TPU users have
today, against the floor of reading the logits once.

    .venv/xla/bin/python bench/tpu_cost_sampling.py        # libtpu 0.0.21: v5e, v5p, v6e

Each row compiles whole for one chip (compile only, nothing runs), for bfloat16 and float32
logits of Llama 3's vocabulary (V = 128256) at B = 1, 8, 64 and 256, with the temperature alone
and with top-k 50 and top-p 0.9 too:

- **torch_pallas**: ``torch_pallas.kernels.token_sampling.sample_tokens`` (keys, thresholds, the
  Gumbel-max kernel).
- **tpu-inference's path**: what vLLM's TPU backend runs for a batch without seeds (its
  ``sample_full_vocab``), written here after its structure: float32 logits over the temperature,
  top-k and top-p masks found by 32-step bisections (a count, then a sum of softmax
  probabilities, per step), then ``jax.random.categorical`` of one key for the batch.
- **torch multinomial**: ``torch.multinomial(torch.softmax(logits.float() / T, -1), 1)`` as
  torch_xla lowers it (temperature only), the graph compiled by :func:`tpu_compile.compile_graph`.

libtpu's estimate (:func:`torch_pallas.tpu_schedule.estimate`) counts a loop at a program's top
level once, so it refuses one: the two bisecting samplers compile here with their 32 steps
unrolled, the same computation as the loop, and the arrays each step reads materialised first
(an optimisation barrier), as a loop's operands are: unrolled, XLA would fuse their computation
into every step, or not, as it judged (this bench swaps ``token_sampling._bisect`` and
``InTrace.bisect`` for :func:`unrolled_bisect` and :func:`bisect_as_its_loop_runs` while it
compiles torch_pallas' sampler). Written to ``results/tpu_cost_sampling.{json,md}``.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

import common
from torch_pallas import tpu_compile, tpu_schedule
from torch_pallas.kernels import token_sampling

VOCABULARY = 128256
BATCHES = (1, 8, 64, 256)
GENERATIONS = ("v5e", "v5p", "v6e")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
FILTERS = {"temperature": {}, "top-k 50, top-p 0.9": dict(top_k=50, top_p=0.9)}
TEMPERATURE = 0.8


def unrolled_bisect(predicate, start):
    """``token_sampling._bisect``'s search with its steps (one per bit of ``start``'s dtype)
    unrolled: no loop for the estimate to refuse."""
    t, width = start, start.dtype.itemsize * 8
    for bit in range(width):
        candidate = t | np.array(1 << (width - 1 - bit), t.dtype)
        t = jnp.where(predicate(candidate), candidate, t)
    return t


_IN_TRACE_BISECT = token_sampling.InTrace.bisect


def bisect_as_its_loop_runs(steps, partial, kind, holds, shard_arguments, row_arguments):
    """``InTrace.bisect`` unrolled, its arrays materialised first, as a loop's operands are (else
    XLA fuses their computation into each of the 32 steps, which the loop does not)."""
    return _IN_TRACE_BISECT(steps, partial, kind, holds, lax.optimization_barrier(shard_arguments), row_arguments)


def torch_pallas_sampler(logits, seed_words, positions, top_k=None, top_p=None):
    batch = logits.shape[0]
    temperature = jnp.full((batch,), TEMPERATURE, jnp.float32)
    per_row = {name: None if value is None else jnp.full((batch,), value, jnp.int32 if name == "top_k" else jnp.float32)
               for name, value in (("top_k", top_k), ("top_p", top_p))}
    return token_sampling.sample_tokens(logits, seed_words, positions, temperature, interpret=False, **per_row)


def float_of_key(keys):
    """The float32 whose order key (``token_sampling.ordered_key``) is ``keys`` (uint32, a row's)."""
    sign = np.uint32(0x80000000)
    return lax.bitcast_convert_type(jnp.where(keys >= sign, keys & np.uint32(0x7FFFFFFF), np.uint32(0) - keys),
                                    jnp.float32)


def tpu_inference_sampler(logits, key_data, top_k=None, top_p=None):
    """vLLM's TPU sampler's structure (not its code): masks by bisection over float32 bit patterns
    (each step compares the floats with the row's candidate, as its float32_bsearch does), then
    one categorical."""
    scaled = logits.astype(jnp.float32) / np.float32(TEMPERATURE)
    masked = np.float32(-1e12)
    if top_k is not None:
        searched = lax.optimization_barrier(scaled)  # as its loop's operand (bisect_as_its_loop_runs)

        def at_least_k(t):
            return jnp.sum(searched >= float_of_key(t)[:, None], axis=-1, dtype=jnp.int32) >= top_k
        cutoff = float_of_key(unrolled_bisect(at_least_k, jnp.zeros(scaled.shape[:1], jnp.uint32)))
        scaled = jnp.where(scaled >= cutoff[:, None], scaled, masked)
    if top_p is not None:
        probabilities = lax.optimization_barrier(jax.nn.softmax(scaled, axis=-1))

        def holds_top_p(t):
            return jnp.sum(jnp.where(probabilities >= float_of_key(t)[:, None], probabilities, 0.0), axis=-1) >= top_p
        least = float_of_key(unrolled_bisect(holds_top_p, jnp.zeros(scaled.shape[:1], jnp.uint32)))
        scaled = jnp.where(probabilities >= least[:, None], scaled, masked)
    return jax.random.categorical(jax.random.wrap_key_data(key_data), scaled, axis=-1)


def _estimate_seconds(compiled):
    return compiled.estimate.seconds


def measure_jax(function, arguments, generation):
    return _estimate_seconds(tpu_compile.analyze_for_tpu(function, *arguments, generation=generation))


def measure_torch_multinomial(generation, batch, dtype):
    import torch
    import torch_xla

    device = torch_xla.device()
    logits = torch.zeros(batch, VOCABULARY, dtype=getattr(torch, dtype)).to(device)
    torch_xla.sync()  # the logits are the graph's input, not computed in it
    probabilities = torch.softmax(logits.float() / TEMPERATURE, dim=-1)
    tokens = torch.multinomial(probabilities, 1)[:, 0]
    return tpu_compile.compile_graph([tokens], generation, estimate=True).estimate.seconds


def measure(generation, batch, dtype, filters):
    logits = jax.ShapeDtypeStruct((batch, VOCABULARY), DTYPES[dtype])
    parameters = FILTERS[filters]
    words = (jax.ShapeDtypeStruct((batch, 2), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32))
    original_bisect = token_sampling._bisect
    token_sampling._bisect, token_sampling.InTrace.bisect = unrolled_bisect, bisect_as_its_loop_runs
    try:
        ours = measure_jax(functools.partial(torch_pallas_sampler, **parameters), (logits, *words), generation)
    finally:
        token_sampling._bisect, token_sampling.InTrace.bisect = original_bisect, _IN_TRACE_BISECT
    peer = measure_jax(functools.partial(tpu_inference_sampler, **parameters),
                       (logits, jax.ShapeDtypeStruct((2,), jnp.uint32)), generation)
    multinomial = measure_torch_multinomial(generation, batch, dtype) if not parameters else None
    floor = batch * VOCABULARY * jnp.dtype(DTYPES[dtype]).itemsize / tpu_schedule.HARDWARE[generation].hbm_bandwidth
    return dict(generation=generation, batch=batch, dtype=dtype, filters=filters, torch_pallas_seconds=ours,
                tpu_inference_seconds=peer, torch_multinomial_seconds=multinomial, floor_seconds=floor)


def main() -> None:
    tpu_compile.enable_estimates()
    rows = [measure(generation, batch, dtype, filters) for generation in GENERATIONS for filters in FILTERS
            for dtype in DTYPES for batch in BATCHES]

    def cell(seconds):
        return "" if seconds is None else seconds * 1e6
    table = common.markdown_table(
        ["TPU", "filters", "dtype", "B", "torch_pallas (µs)", "tpu-inference's path (µs)", "torch multinomial (µs)",
         "floor (µs)", "torch_pallas / floor", "torch_pallas / tpu-inference"],
        [(r["generation"], r["filters"], r["dtype"], r["batch"], cell(r["torch_pallas_seconds"]),
          cell(r["tpu_inference_seconds"]), cell(r["torch_multinomial_seconds"]), cell(r["floor_seconds"]),
          r["torch_pallas_seconds"] / r["floor_seconds"], r["torch_pallas_seconds"] / r["tpu_inference_seconds"])
         for r in rows])
    notes = ("\nlibtpu's compile-only estimates, not measurements; the floor is reading the logits once. "
             "torch_pallas draws Threefry-2x32-20 bits and two polynomial logarithms per vocabulary entry "
             "(torch_pallas.kernels.token_sampling): that work, not memory, sets its time. tpu-inference's path "
             "(written here after its structure) draws the same Threefry bits with the device's logarithms, "
             "for one key per batch: neither per-request seeds nor batch invariance. The bisections of both "
             "compile unrolled here, the arrays their steps read materialised first as a loop's operands are "
             "(the estimate refuses a loop at a program's top level).\n")
    common.write("tpu_cost_sampling", dict(mode="compile-only", vocabulary=VOCABULARY, temperature=TEMPERATURE,
                                           rows=rows), table + notes, None)
    print(table + notes)


if __name__ == "__main__":
    main()
