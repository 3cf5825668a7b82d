"""The peers on the same compiler: forward + backward of ``y = r + dropout(x, 0.1)`` compiled for TPU.

    .venv/bin/python bench/tpu_peers.py                        # markdown on stdout (for tpu_cost.md)
    .venv/bin/python bench/tpu_peers.py --sizes 22 --dtypes float32 --generations v5e

One program per peer, size (2**22, 2**24 elements), dtype and TPU generation, whose outputs are y
and x's gradient for an incoming gradient g (x, r, g are inputs), compiled whole by libtpu's
compile-only client (nothing runs on a TPU):

- ``torch F.dropout`` and torch_pallas (``threefry``, ``hardware``): the torch_xla lazy graph of
  ``y = r + dropout(x); y.backward(g)``, built under ``tpu_compile.lowering_for_tpu()`` (torch_pallas's
  kernels are Mosaic custom calls in it) and compiled by ``tpu_compile.compile_graph``; and the
  fused form, ``y = torch_pallas.dropout_add(x, r)`` (one kernel reads x and r and writes y);
- ``jax bernoulli threefry2x32 / rbg / unsafe_rbg``: ``jax.jit`` of ``jax.vjp`` of
  ``r + where(bernoulli(key, 0.9, x.shape), x / 0.9, 0)`` with that key impl, compiled by
  ``tpu_compile.compile_for_tpu``.

Reported per generation: the compiler's static schedule of the whole program (bundles / clock,
summed over its top-level program and every fusion and kernel, each run through its control flow by
``torch_pallas.tpu_schedule.executed_schedule`` on libtpu's final-bundles dumps: the ``bundles`` of
``tpu_schedule.estimate``), HBM bytes (``tpu_schedule.hbm_bytes``: from the optimised HLO's buffer
placement; the ``cost_analysis()`` total counts buffers the compiler keeps out of HBM) and their time at the published bandwidth, peak memory
(``peak_memory_in_bytes``), temporaries, and what the backward reads of the forward (from the
optimised HLO: a saved mask, or the RNG recomputed from the key).
"""

from __future__ import annotations

import argparse
import importlib.metadata
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

from common import markdown_table  # noqa: E402
from torch_pallas import tpu_compile, tpu_schedule  # noqa: E402
from torch_pallas.tpu_schedule import HARDWARE, HLO_ARRAY  # noqa: E402

# libtpu's dump of each compile's code, read when libtpu initialises (``GENERATIONS`` below).
tpu_compile.enable_estimates()

P = 0.1
PEERS = ("torch F.dropout", "jax threefry2x32", "jax rbg", "jax unsafe_rbg",
         "torch_pallas threefry", "torch_pallas hardware",
         "torch_pallas dropout_add threefry", "torch_pallas dropout_add hardware")


def program_schedule(dumps, generation):
    """The schedule of one compiled program (its ``tpu_compile.compiler_dumps()``): total bundles
    (``tpu_schedule.estimate``'s: its top-level program, straight line here, plus each XLA fusion
    and Pallas kernel run through its control flow, so that a fusion's guarded body counts its
    windows and a kernel's pipeline-only grid steps are left out) and {part: bundles}."""
    step = tpu_schedule.estimate(dumps, generation)
    parts = {"TLP": step.program_bundles, **{op.name: op.bundles for op in step.ops if op.kind != "copy"}}
    return step.bundles, parts


# --- the programs --------------------------------------------------------------------------------------------------

def jax_program(impl):
    def step(seed, x, r, g):
        key = jax.random.key(seed, impl=impl)

        def forward(x):
            keep = jax.random.bernoulli(key, 1 - P, x.shape)
            return r + jnp.where(keep, x / (1 - P), 0).astype(x.dtype)
        y, vjp = jax.vjp(forward, x)
        return y, vjp(g)[0]
    return step


def compile_jax(impl, shape, dtype, generation):
    specs = [jax.ShapeDtypeStruct((), jnp.uint32)] + [jax.ShapeDtypeStruct(shape, dtype)] * 3
    compiled = tpu_compile.compile_for_tpu(jax_program(impl), *specs, generation=generation)
    memory = compiled.runtime_executable().get_compiled_memory_stats()
    cost = compiled.cost_analysis()
    return memory, dict(cost[0] if isinstance(cost, (list, tuple)) else cost)


def compile_torch(peer, shape, dtype, generation):
    import torch
    import torch.nn.functional as F
    import torch_xla

    import torch_pallas

    device = torch_xla.device()
    torch_dtype = getattr(torch, dtype)
    with tpu_compile.lowering_for_tpu():
        x = torch.zeros(shape, dtype=torch_dtype, device=device).requires_grad_()
        r = torch.zeros(shape, dtype=torch_dtype, device=device)
        g = torch.zeros(shape, dtype=torch_dtype, device=device)
        # Device data, not constants the compiler could fold: the graph's inputs, as in training.
        torch_xla.sync()
        if peer == "torch F.dropout":
            y = r + F.dropout(x, P, training=True)
        elif "dropout_add" in peer:  # the fused form: one kernel reads x and r and writes y
            y = torch_pallas.dropout_add(x, r, P, seed=1234, impl=peer.split()[-1])
        else:
            y = r + torch_pallas.dropout(x, P, seed=1234, impl=peer.split()[-1])
        y.backward(g)
        outputs = [y, x.grad]
        compiled = tpu_compile.compile_graph(outputs, generation)
    # The CPU client cannot run these graphs (Mosaic custom calls): drop them before anything syncs.
    del outputs, y, x
    return compiled


def measure(peer, shape, dtype, generation):
    with tpu_compile.compiler_dumps() as dumps:
        start = time.perf_counter()
        if peer.startswith("jax"):
            memory, cost = compile_jax(peer.split()[1], shape, getattr(jnp, dtype), generation)
            peak, temp = memory.peak_memory_in_bytes, memory.temp_size_in_bytes
        else:
            compiled = compile_torch(peer, shape, dtype, generation)
            peak, temp, cost = compiled.peak_bytes, compiled.temp_bytes, compiled.cost
        seconds = time.perf_counter() - start
    bundles, parts = program_schedule(dumps, generation)
    hlo = tpu_schedule.optimized_hlo(dumps)
    return dict(seconds=seconds, peak=peak, temp=temp, bytes=tpu_schedule.hbm_bytes(hlo),
                xla_bytes=cost.get("bytes accessed", 0.0), bundles=bundles, parts=parts,
                saved=saved_for_backward(peer, hlo, math.prod(shape)))


def saved_for_backward(peer, hlo, numel):
    """What passes from the forward to the backward, from the optimised HLO's entry computation:
    the non-float buffers of x's size (a pred mask, u32 random bits) that instructions write, and
    where the compiler placed them (S(n): a memory space other than HBM), or nothing but the key."""
    if peer.startswith("torch_pallas"):
        return "the 8-byte key (both kernels take it; no mask buffer)"
    entry = tpu_schedule.entry_computation(hlo)
    found = []
    for line in entry.splitlines():
        match = re.match(r"\s*(?:ROOT )?%([\w.-]+) = (.*?) ([\w-]+)\(", line)
        if not match or match.group(3) in ("get-tuple-element", "bitcast", "tuple", "parameter"):
            continue
        for dtype, dims, layout in HLO_ARRAY.findall(match.group(2)):
            if dtype in ("pred", "u8", "s8", "u32", "s32") and math.prod(int(d) for d in dims.split(",") if d) == numel:
                place = "HBM" if "S(" not in layout else re.search(r"S\(\d+\)", layout).group(0)
                found.append(f"{dtype} {'mask' if dtype == 'pred' else 'bits'} from {match.group(3)} ({place})")
    if not found:
        return "nothing of x's size: one fusion draws the bits once for y and x's gradient"
    return "; ".join(found)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", type=int, default=[22, 24], help="log2 of the element counts")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--generations", nargs="*", default=list(tpu_compile.GENERATIONS))
    parser.add_argument("--peers", nargs="*", default=list(PEERS))
    parser.add_argument("--parts", action="store_true", help="also every fusion's and kernel's bundles")
    options = parser.parse_args()
    if not tpu_compile.available():
        sys.exit("libtpu (the TPU compiler) is not installed")
    rows, saved, parts = [], {}, []
    for log2 in options.sizes:
        shape = (2**log2 // 1024, 1024)
        for dtype in options.dtypes:
            for peer in options.peers:
                cells = []
                for generation in options.generations:
                    r = measure(peer, shape, dtype, generation)
                    hw = HARDWARE[generation]
                    schedule_us = r["bundles"] / hw.clock * 1e6
                    hbm_us = r["bytes"] / hw.hbm_bandwidth * 1e6
                    cells.append((schedule_us, hbm_us, r))
                    saved[peer, dtype] = r["saved"] if generation == options.generations[0] else saved[peer, dtype]
                    parts.append([f"2^{log2}", dtype, peer, generation,
                                  ", ".join(f"{k} {v}" for k, v in r["parts"].items())])
                    print(peer, f"2^{log2}", dtype, generation, f"{r['seconds']:.1f} s", file=sys.stderr, flush=True)
                rows.append([f"2^{log2}", dtype, peer] + [
                    f"{s:.1f} / {h:.1f} / {r['peak'] / 2**20:.0f} / {r['temp'] / 2**20:.0f}" for s, h, r in cells])
    libtpu = importlib.metadata.version("libtpu")
    print(f"Generated by `.venv/bin/python bench/tpu_peers.py` (libtpu {libtpu}'s compile-only client, "
          f"jax {jax.__version__}). Per generation: the whole program's static schedule in µs (bundles / clock, "
          "summed over its fusions and kernels, each counted by `tpu_schedule.executed_schedule`) / HBM time in µs "
          "(bytes the optimised HLO moves to and from HBM, `tpu_schedule.hbm_bytes`, / published bandwidth) / peak MiB "
          "(`peak_memory_in_bytes`) / temp MiB. Nothing ran on a TPU.\n")
    print(markdown_table(["elements", "dtype", "peer", *options.generations], rows))
    print(f"\n**What the backward reads of the forward** (optimised HLO, {options.generations[0]}, the largest size):\n")
    print(markdown_table(["peer", "dtype", "saved for the backward"], [[p, d, s] for (p, d), s in saved.items()]))
    if options.parts:
        print(markdown_table(["elements", "dtype", "peer", "gen", "bundles per fusion / kernel"], parts))


if __name__ == "__main__":
    main()
