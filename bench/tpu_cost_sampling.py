"""torch_pallas.sample_tokens on the TPU compiler: the sampler's schedule against the floor of
reading its logits once.

    .venv/xla/bin/python bench/tpu_cost_sampling.py        # libtpu 0.0.21: v5e, v5p, v6e

One program per row: ``torch_pallas.kernels.token_sampling.sample_tokens`` (keys, thresholds,
the Gumbel-max kernel) over bfloat16 and float32 logits of Llama 3's vocabulary (V = 128256) at
B = 1, 8, 64 and 256, compiled whole for one chip (compile only, nothing runs), with the
temperature alone: top-k and top-p search their thresholds in a loop at the program's top level,
which the estimate does not count (``tpu_schedule.estimate`` refuses it). Reported: libtpu's
estimate (``tpu_compile.analyze_for_tpu``), the sampling kernel's share of it, the floor (the
logits' bytes / published HBM bandwidth) and the ratio. Written to
``results/tpu_cost_sampling.{json,md}``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import common
from torch_pallas import tpu_compile, tpu_schedule
from torch_pallas.kernels import token_sampling

VOCABULARY = 128256
BATCHES = (1, 8, 64, 256)
GENERATIONS = ("v5e", "v5p", "v6e")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def measure(generation: str, batch: int, dtype: str) -> dict:
    arguments = (jax.ShapeDtypeStruct((batch, VOCABULARY), DTYPES[dtype]), jax.ShapeDtypeStruct((batch, 2), jnp.int32),
                 jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.float32))
    compiled = tpu_compile.analyze_for_tpu(functools.partial(token_sampling.sample_tokens, interpret=False), *arguments,
                                           generation=generation)
    floor = batch * VOCABULARY * jnp.dtype(DTYPES[dtype]).itemsize / tpu_schedule.HARDWARE[generation].hbm_bandwidth
    kernel = sum(op.seconds for op in compiled.estimate.ops if op.name.startswith("sample_tokens"))
    return dict(generation=generation, batch=batch, dtype=dtype, seconds=compiled.estimate.seconds,
                kernel_seconds=kernel, floor_seconds=floor, ratio=compiled.estimate.seconds / floor)


def main() -> None:
    tpu_compile.enable_estimates()
    rows = [measure(generation, batch, dtype) for generation in GENERATIONS for dtype in DTYPES for batch in BATCHES]
    table = common.markdown_table(
        ["TPU", "dtype", "B", "estimate (µs)", "sampling kernel (µs)", "floor (µs)", "estimate / floor"],
        [(r["generation"], r["dtype"], r["batch"], r["seconds"] * 1e6, r["kernel_seconds"] * 1e6,
          r["floor_seconds"] * 1e6, r["ratio"]) for r in rows])
    notes = ("\nlibtpu's compile-only estimates, not measurements. The floor is reading the logits once. "
             "The kernel draws Threefry-2x32-20 bits and two polynomial logarithms per vocabulary entry "
             "(torch_pallas.kernels.token_sampling): that work, not memory, sets its time.\n")
    common.write("tpu_cost_sampling", dict(mode="compile-only", vocabulary=VOCABULARY, rows=rows), table + notes, None)
    print(table + notes)


if __name__ == "__main__":
    main()
