"""What the TPU compiler says each kernel costs at 2**22 elements, on a machine without a TPU.

    .venv/bin/python bench/tpu_cost.py                 # markdown tables on stdout
    .venv/bin/python bench/tpu_cost.py --only dropout  # kernels whose name starts with this (here dropout,
                                                       # dropout_add, dropout_matmul_* and the what-if rows)
    .venv/bin/python bench/tpu_cost.py --what-if       # also the hardware PRNG seeded per smaller tiles
    .venv/bin/python bench/tpu_cost.py --only dropout --impls tiled  # the tiled impl's dropout rows alone
    .venv/bin/python bench/tpu_cost.py --only attention  # the flash-attention rows alone (bench/tpu_cost_attention.py)

Each kernel (dropout, which is also its own backward; dropout_add, ``residual + dropout(x)``;
dropout_matmul forward and backward, ``dropout(weights) @ value`` and with ``softmax=True``
``dropout(softmax(scores)) @ value``, on (B·H, L, S) = (16, 512, 512) weights and a (16, 512, 64)
value; uniform / normal / bernoulli sampling; the IndRNN forward and backward), dtype (float32,
bfloat16), noise impl (threefry, hardware, tiled) and TPU generation (v4, v5e, v5p, v6e) is compiled
with the library's default blocks by libtpu's compile-only client (torch_pallas.tpu_compile,
interpret=False). Reported:

- compile time; ``compiled.memory_analysis()`` (argument / output / temp bytes, generated code
  size); ``compiled.cost_analysis()`` (flops, bytes accessed);
- from libtpu's own dump of the kernel's final VLIW bundles (``tpu_compile.enable_estimates()``):
  the static schedule (``torch_pallas.tpu_schedule.static_schedule``). Every loop's bundles are counted once per iteration (its trip count read from its
  ``loop exit test``); the grid loop's two pipeline stages that skip the body are left out. This
  gives the kernel's bundle count (= cycles if nothing stalls) per TensorCore, and its vector-ALU
  operations (``tpu_schedule.vector_unit``: ``v*`` ops but the matrix, cross-lane and EUP units',
  loads, stores, syncs, vrng and logic on compare masks) per element. For dropout_matmul, per
  weight; its kernels initialise and write their accumulators under ``pl.when``, so they are
  counted by ``tpu_schedule.executed_schedule`` (below);
- the roofline: HBM bytes (from the BlockSpecs) at the published bandwidth vs the schedule's cycles
  at the clock (constants in ``torch_pallas.tpu_schedule.HARDWARE``).

Nothing runs on a TPU: the cycle counts are the compiler's schedule, not measurements, and DMA
waits (the HBM-bound part) are not in them.

The attention rows (``--only attention``; ``bench/tpu_cost_attention.py``) and the whole programs of
``bench/tpu_peers.py`` count bundles with ``tpu_schedule.executed_schedule`` instead, which runs each kernel's (and
XLA fusion's) scalar control flow so that regions under ``pl.when`` count as often as they run (it
agrees with ``static_schedule`` within 1 % on the elementwise and IndRNN kernels, which branch only
around their pipeline's first and last steps).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import itertools
import math
import os
import re
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_pallas  # noqa: E402,F401  (torch_xla before JAX; pins the Mosaic IR version libtpu accepts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tpu_cost_attention  # noqa: E402
from common import markdown_table  # noqa: E402
from torch_pallas import tpu_compile, tpu_schedule  # noqa: E402
from torch_pallas.kernels import dropout, dropout_matmul, indrnn, prng, sampling, tiling  # noqa: E402
from torch_pallas.tpu_schedule import HARDWARE, static_schedule  # noqa: E402

# libtpu's dump of each kernel's final bundles, read when libtpu initialises (at the first compile below).
tpu_compile.enable_estimates()

N = 2**22
VIEW = (4096, 1024)         # 2**22 elements, the 2-D view every elementwise kernel uses at this size
T, B, F = 1024, 8, 512      # 2**22 elements; default blocks (64, 8, 512)
# dropout_matmul on eager attention's weights (B·H, L, S), 2**22 of them (batch 2 x 8 heads at 512 tokens,
# say), and its value (B·H, S, Ev) with a head dim of 64; the output and its gradient are (B·H, L, Ev).
WEIGHTS, VALUE, OUTPUT = (16, 512, 512), (16, 512, 64), (16, 512, 64)
KEY = jax.ShapeDtypeStruct((2,), jnp.int32)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def configurations(impls=prng.IMPLS):
    """Every kernel at 2**22 elements with default blocks: its name, dtype, impl (of ``impls``), the
    HBM bytes its BlockSpecs move (read + write), and the function and arguments to compile; with
    ``branches``, its grid steps branch (see :func:`measure`)."""
    for dtype_name, dtype in DTYPES.items():
        size = jnp.dtype(dtype).itemsize
        x = jax.ShapeDtypeStruct(VIEW, dtype)
        for impl in impls:
            # Reads x (and dropout_add's residual), writes y (dropout's backward: reads the gradient,
            # writes grad_x); the key is 8 bytes.
            for kernel, operands in (("dropout", (x,)), ("dropout_add", (x, x))):
                yield dict(kernel=kernel, dtype=dtype_name, impl=impl, bytes=(len(operands) + 1) * N * size + 8,
                           args=(KEY, *operands),
                           function=functools.partial(getattr(dropout, kernel), p=0.1, impl=impl, interpret=False))
            yield from _dropout_matmul_configurations(dtype_name, dtype, impl)
            for distribution in ("uniform", "normal") + (("bernoulli",) if dtype_name == "float32" else ()):
                bernoulli = distribution == "bernoulli"  # the kernel writes int32; a cast to bool follows it
                out_size = 4 if bernoulli else size
                yield dict(kernel=distribution, dtype="bool (int32)" if bernoulli else dtype_name, impl=impl,
                           bytes=N * out_size + 8, args=(KEY,),
                           function=functools.partial(sampling.sample, shape=VIEW, distribution=distribution,
                                                      dtype=dtype, p=0.3, impl=impl, interpret=False))
        sequence, state = jax.ShapeDtypeStruct((T, B, F), dtype), jax.ShapeDtypeStruct((B, F), dtype)
        weight = jax.ShapeDtypeStruct((F,), jnp.float32)
        time_blocks = math.ceil(T / tiling.resolve_recurrence(None, T, B, F, dtype, interpret=False).time)
        # The kernels' own cost_estimates: forward reads x, writes output (+ h0, h_n, the weight row);
        # backward reads grad_output and output, writes grad_x (+ one output row per time block, h0,
        # grad_h_n, grad_h0 and the float32 weight-gradient rows).
        forward_bytes = 2 * N * size + 2 * B * F * size + F * 4
        backward_bytes = (3 * N + time_blocks * B * F + 3 * B * F) * size + 4 * B * F
        for nonlinearity in indrnn.NONLINEARITIES:
            options = dict(nonlinearity=nonlinearity, interpret=False)
            yield dict(kernel=f"indrnn_forward {nonlinearity}", dtype=dtype_name, impl="-",
                       bytes=forward_bytes, args=(sequence, weight, state),
                       function=functools.partial(indrnn.indrnn_forward, **options))
            yield dict(kernel=f"indrnn_backward {nonlinearity}", dtype=dtype_name, impl="-",
                       bytes=backward_bytes, args=(sequence, state, sequence, weight, state),
                       function=functools.partial(indrnn.indrnn_backward, **options))


def _dropout_matmul_configurations(dtype_name, dtype, impl):
    """``dropout(weights) @ value`` forward and backward, without and with the softmax before the
    dropout. At these shapes each kernel moves each block once (one block of S; with softmax
    whole rows): the forward reads the weights (or scores) and the value and writes the output;
    the backward also reads the output's gradient and writes the weights' and the value's."""
    weights, value, output = (jax.ShapeDtypeStruct(shape, dtype) for shape in (WEIGHTS, VALUE, OUTPUT))

    def moved(*arrays):  # + the 8-byte key
        return sum(math.prod(array.shape) for array in arrays) * jnp.dtype(dtype).itemsize + 8
    for softmax in (False, True):
        options = dict(p=0.1, impl=impl, interpret=False, softmax=softmax)
        for direction, args, bytes_moved in (("forward", (KEY, weights, value), moved(weights, value, output)),
                                             ("backward", (KEY, weights, value, output),
                                              moved(weights, value, output, weights, value))):
            yield dict(kernel=f"dropout_matmul_{direction}{' softmax' if softmax else ''}", dtype=dtype_name,
                       impl=impl, bytes=bytes_moved, args=args, branches=True,
                       function=functools.partial(getattr(dropout_matmul, f"dropout_matmul_{direction}"), **options))


def grid_size(function, args):
    """Grid steps of the one Pallas kernel ``function(*args)`` calls (traced, not compiled)."""
    def grids(jaxpr):
        for equation in jaxpr.eqns:
            if equation.primitive.name == "pallas_call":
                yield equation.params["grid_mapping"].grid
            for value in equation.params.values():
                for inner in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                    if hasattr(inner, "eqns"):
                        yield from grids(inner)
    (grid,) = grids(jax.make_jaxpr(function)(*args).jaxpr)
    return math.prod(grid)


@contextlib.contextmanager
def hardware_tile_elements(elements):
    """The library's hardware PRNG seeded per tile of up to ``elements`` (tiling.HARDWARE_TILE_ELEMENTS,
    64 * 1024 as shipped) while the block is entered: the kernel reads the constant when it is traced."""
    shipped, tiling.HARDWARE_TILE_ELEMENTS = tiling.HARDWARE_TILE_ELEMENTS, elements
    try:
        yield
    finally:
        tiling.HARDWARE_TILE_ELEMENTS = shipped


def what_if_configurations():
    """The library's hardware dropout with smaller seed tiles than it ships, (8, 1024) and (32, 1024) over
    this view: the comparison that chose (64, 1024) (tiling.HARDWARE_TILE_ELEMENTS)."""
    for dtype_name, dtype in DTYPES.items():
        for elements in (8 * 1024, 32 * 1024):
            with hardware_tile_elements(elements):
                tile = tiling.hardware_tile(*VIEW)

            def function(key, x, elements=elements):
                with hardware_tile_elements(elements):
                    return dropout.dropout(key, x, p=0.1, impl="hardware", interpret=False)
            yield dict(kernel=f"dropout, hardware PRNG per {tile} tile (what-if)", dtype=dtype_name, impl="hardware",
                       bytes=2 * N * jnp.dtype(dtype).itemsize + 8, function=function,
                       args=(KEY, jax.ShapeDtypeStruct(VIEW, dtype)))


# --- one compile ------------------------------------------------------------------------------------------------

def measure(function, args, generation, branches=False):
    """One compile of ``function(*args)`` for ``generation``: its analyses and its kernels' schedule.
    Bundles and VALU ops are the static schedule's (every conditional region on every grid step: exact
    for kernels that branch only around their pipeline's first and last steps), or with ``branches``
    (kernels that initialise and write accumulators under ``pl.when``) executed_schedule's, their
    VALU ops told from the matrix and cross-lane units' by ``tpu_schedule.vector_unit``."""
    with tpu_compile.compiler_dumps() as dumps:
        start = time.perf_counter()
        compiled = tpu_compile.compile_for_tpu(function, *args, generation=generation)
        seconds = time.perf_counter() - start
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    kernels = list(tpu_schedule.kernel_dumps(dumps).values())
    schedules = [static_schedule(dump) for dump in kernels]
    if branches:
        # These kernels' bundles also hold matrix-unit and cross-lane ops: VALU ops are counted by unit.
        runs = [tpu_schedule.executed_schedule(dump, generation) for dump in kernels]
        valu = [(count, sum(tpu_schedule.vector_unit(op) == "VALU" for op in ops))
                for run in runs for count, ops in zip(run["counts"], run["ops"])]
        bundles = sum(run["bundles"] for run in runs)
        valu_ops, max_valu = sum(count * ops for count, ops in valu), max(ops for _, ops in valu)
    else:
        bundles, valu_ops = sum(s["bundles"] for s in schedules), sum(s["valu_ops"] for s in schedules)
        max_valu = max(s["max_valu_per_bundle"] for s in schedules)
    return {
        "compile_s": seconds, "memory": memory, "cost": cost,
        "serialized_bytes": len(compiled.runtime_executable().serialize()), "hlo_text_chars": len(compiled.as_text()),
        "bundles": bundles, "valu_ops": valu_ops, "grid_steps": schedules[0]["grid_trip"],
        "max_valu_per_bundle": max_valu,
    }


def _cost_bytes(cost):
    """XLA's "bytes accessed": its total where the kernel has a cost_estimate (every kernel since
    kernels/calls.py; only IndRNN's before); a Pallas call without one is missing from the total,
    so then the sum of its operands' and outputs' sizes."""
    operands = sum(v for k, v in cost.items() if re.fullmatch(r"bytes accessed(\d+|out)\{\d*\}", k))
    return max(cost.get("bytes accessed", 0.0), operands)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="kernels whose name starts with this ('attention': the attention rows alone)")
    parser.add_argument("--generations", nargs="*", default=list(tpu_compile.GENERATIONS))
    parser.add_argument("--what-if", action="store_true",
                        help="also the library's hardware dropout seeded per (8, 1024) and (32, 1024) tiles, "
                             "the smaller tiles (64, 1024) was chosen over")
    parser.add_argument("--long", action="store_true", help="also one row per generation with every figure")
    parser.add_argument("--impls", nargs="*", default=list(prng.IMPLS), choices=prng.IMPLS,
                        help="the noise impls of the elementwise rows (the IndRNN rows have none)")
    options = parser.parse_args()
    if not tpu_compile.available():
        sys.exit("libtpu (the TPU compiler) is not installed")
    selected = [c for c in itertools.chain(configurations(options.impls),
                                           what_if_configurations() if options.what_if else ())
                if not options.only or c["kernel"].startswith(options.only)]
    if selected:
        elementwise_and_recurrence(selected, options)
    if not options.only or "attention".startswith(options.only):
        section = tpu_cost_attention.run(options.generations)
        print(f"Generated by `.venv/bin/python bench/tpu_cost.py --only attention` (libtpu "
              f"{importlib.metadata.version('libtpu')}'s compile-only client, jax {jax.__version__}); "
              f"{tpu_cost_attention.DTYPE}, the library's default blocks. Nothing ran on a TPU.\n")
        print(section)


def elementwise_and_recurrence(selected, options):
    """The tables of the elementwise and IndRNN kernels (``selected`` configurations)."""
    compile_rows, roofline_rows, long_rows, max_valu = [], [], [], {}
    for c in selected:
        name = [c["kernel"], c["dtype"], c["impl"]]
        compile_cells, roofline_cells, summary = [], [], None
        grid = grid_size(c["function"], c["args"])
        for generation in options.generations:
            try:
                r = measure(c["function"], c["args"], generation, c.get("branches", False))
            except Exception as error:  # the table reports what libtpu said
                compile_cells.append("rejected: " + str(error).splitlines()[0][:80])
                roofline_cells.append("—")
                continue
            m, hw = r["memory"], HARDWARE[generation]
            # The grid loop ran grid / cores steps: 2 where the compiler split the "parallel" grid over a
            # megacore's two TensorCores, each then doing half the elements.
            cores = grid // r["grid_steps"] if r["grid_steps"] else 1
            valu_per_element = r["valu_ops"] * 1024 / (N / cores)    # vector ops act on 8 x 128 32-bit lanes
            bundles_per_vreg = r["bundles"] * 1024 / (N / cores)
            memory_us = c["bytes"] / hw.hbm_bandwidth * 1e6
            valu_us = r["valu_ops"] / (hw.valu_slots * hw.clock) * 1e6
            schedule_us = r["bundles"] / hw.clock * 1e6
            bound = "memory" if memory_us >= schedule_us else "compute"
            ratio = max(memory_us, schedule_us) / min(memory_us, schedule_us)
            compile_cells.append(f"{r['compile_s']:.2f} s / {m.generated_code_size_in_bytes / 2**10:.0f} / "
                                 f"{r['serialized_bytes'] / 2**10:.0f} / {m.temp_size_in_bytes / 2**10:.0f}")
            roofline_cells.append(f"{memory_us:.1f} / {valu_us:.1f} / {schedule_us:.1f} ({bound[0].upper()} "
                                  f"{ratio:.1f}x{', 2 TC' if cores == 2 else ''})")
            flops, cost_bytes = f"{r['cost'].get('flops', 0.0):.3g}", _cost_bytes(r["cost"])
            long_rows.append(name + [
                generation, f"{r['compile_s']:.2f}", m.argument_size_in_bytes, m.output_size_in_bytes,
                m.temp_size_in_bytes, m.generated_code_size_in_bytes, r["serialized_bytes"], r["hlo_text_chars"],
                flops, f"{cost_bytes:.0f}", f"{grid} / {cores}", f"{valu_per_element:.0f}",
                f"{bundles_per_vreg:.1f}", f"{memory_us:.1f}", f"{valu_us:.1f}", f"{schedule_us:.1f}",
                f"{bound} ({ratio:.1f}x)"])
            max_valu[generation] = max(max_valu.get(generation, 0), r["max_valu_per_bundle"])
            # Generation-independent columns, and the VALU ops of the last generation compiled.
            summary = [f"{m.argument_size_in_bytes / 2**20:.2f}", f"{m.output_size_in_bytes / 2**20:.2f}", flops,
                       f"{cost_bytes / 2**20:.2f}", f"{valu_per_element:.0f}"]
            print(" ".join(name), generation, f"{r['compile_s']:.2f} s", file=sys.stderr, flush=True)
        if summary is None:
            summary = ["—"] * 5
        compile_rows.append(name + summary[:4] + compile_cells)
        roofline_rows.append(name + [f"{c['bytes'] / N:.2f}", summary[4]] + roofline_cells)
    libtpu = importlib.metadata.version("libtpu")
    command = " ".join(["bench/tpu_cost.py"] + sys.argv[1:])
    print(f"Generated by `.venv/bin/python {command}` (libtpu {libtpu}'s "
          f"compile-only client, jax {jax.__version__}); {N} elements: elementwise view {VIEW}, IndRNN (T, B, F) = "
          f"{(T, B, F)}, dropout_matmul weights (B·H, L, S) = {WEIGHTS} with value {VALUE} (p = 0.1; its "
          "per-element figures are per weight); the library's default blocks. Nothing ran on a TPU.\n")
    print("**Roofline.** B / elem: HBM bytes read + written per element (BlockSpecs); VALU ops / elem: vector-ALU "
          f"ops per 32-bit lane in the compiled kernel ({options.generations[-1]}); per generation, in µs: HBM time "
          "(bytes / published bandwidth) / VALU-peak time (the kernel's VALU ops / (VALU slots x clock)) / the "
          "compiler's static schedule (bundles / clock); then whether HBM or the schedule is longer (M memory, "
          "C compute) and by how much; 2 TC: the grid was split over two TensorCores.\n")
    print(markdown_table(["kernel", "dtype", "impl", "B / elem", "VALU ops / elem", *options.generations],
                         roofline_rows))
    print("Most vector-ALU ops seen in one bundle: " + ", ".join(f"{g} {v}" for g, v in max_valu.items()) + "\n")
    print("**Compile tier.** args / out: `memory_analysis()` argument and output sizes; XLA flops / bytes: "
          "`cost_analysis()` (a Pallas call without a cost_estimate reports no flops; bytes are then its operands' "
          "and outputs' sizes); per generation: compile time / generated code KiB / serialized executable KiB / "
          "temp KiB.\n")
    print(markdown_table(["kernel", "dtype", "impl", "args MiB", "out MiB", "XLA flops", "XLA bytes MiB",
                          *options.generations], compile_rows))
    if options.long:
        print(markdown_table(["kernel", "dtype", "impl", "gen", "compile s", "args B", "out B", "temp B", "code B",
                              "serialized B", "HLO text chars", "XLA flops", "XLA bytes", "grid / cores",
                              "VALU ops / elem", "bundles / 1024 elem", "HBM us", "VALU-peak us", "schedule us",
                              "bound"], long_rows))


if __name__ == "__main__":
    main()
