"""TPU compilation of the benchmarked kernels, with libtpu's compile-only client (no TPU).

For every generation: does each benchmarked configuration compile with the library's
default blocks (dropout at 2^22 elements, forward = backward kernel, both noise impls; the
IndRNN forward and backward at the benchmark shapes), and how long does the compile take.
Run times need a TPU and are not measured here.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from common import markdown_table, write
from torch_pallas import tpu_compile
from torch_pallas.kernels import dropout, indrnn

KEY = jax.ShapeDtypeStruct((2,), jnp.int32)


def configurations():
    for dtype in (jnp.float32, jnp.bfloat16):
        for impl in ("threefry", "hardware"):
            yield (f"dropout 2^22 {impl}", dtype,
                   functools.partial(dropout.dropout, p=0.1, impl=impl, interpret=False),
                   (KEY, jax.ShapeDtypeStruct((4096, 1024), dtype)))
        for T, B, F in ((1000, 1, 1000), (512, 64, 512)):
            sequence, state = jax.ShapeDtypeStruct((T, B, F), dtype), jax.ShapeDtypeStruct((B, F), dtype)
            weight = jax.ShapeDtypeStruct((F,), jnp.float32)
            options = dict(nonlinearity="relu", interpret=False)
            yield (f"IndRNN forward ({T}, {B}, {F})", dtype, functools.partial(indrnn.indrnn_forward, **options),
                   (sequence, weight, state))
            yield (f"IndRNN backward ({T}, {B}, {F})", dtype, functools.partial(indrnn.indrnn_backward, **options),
                   (sequence, state, sequence, weight, state))


def run(full: bool) -> str:
    del full  # one compile per configuration either way
    if not tpu_compile.available():
        return "skipped: libtpu is not installed (./dev installs it with the test extra)"
    rows, records = [], []
    for name, dtype, function, args in configurations():
        row = [name, jnp.dtype(dtype).name]
        for generation in tpu_compile.GENERATIONS:
            start = time.perf_counter()
            try:
                tpu_compile.compile_for_tpu(function, *args, generation=generation)
                outcome = f"{time.perf_counter() - start:.2f} s"
            except Exception as error:  # the table reports what libtpu said
                outcome = "rejected: " + str(error).splitlines()[0][:120]
            row.append(outcome)
            records.append({"kernel": name, "dtype": row[1], "generation": generation, "compile": outcome})
        rows.append(row)
    table = markdown_table(["kernel (default blocks)", "dtype", *tpu_compile.GENERATIONS], rows)
    table = ("Compiled by libtpu 0.0.21's compile-only client on this CPU machine (no TPU): each cell is the "
             "compile time, or libtpu's rejection. TPU run times are not measured.\n\n" + table)
    write("tpu_compile", {"mode": "compile only", "results": records}, table, None)
    return table
