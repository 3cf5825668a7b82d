"""The attention rows of ``bench/tpu_cost.py``: flash attention with dropout on the TPU compiler.

    .venv/bin/python bench/tpu_cost.py --only attention        # this section alone, markdown on stdout
    .venv/bin/python bench/tpu_cost.py --only attention --generations v5e

Programs, each compiled whole for one TPU of each generation by libtpu's compile-only client
(nothing runs on a TPU), at (B, H, L, E) = (2, 8, 2048, 64) and (2, 8, 2048, 128), bfloat16,
non-causal and causal, as a forward (the output) and a forward+backward (``jax.vjp``: the output
and the gradients of q, k, v for an incoming gradient; inputs key, q, k, v and that gradient):

- ``ours``: ``torch_pallas.kernels.attention.attention`` (its custom_vjp: the forward kernel, then
  the key/value and query backward kernels) with its default blocks, at dropout_p 0 and 0.1 with
  each impl (threefry, hardware, tiled);
- ``jax flash``: JAX's own Pallas kernel, ``jax.experimental.pallas.ops.tpu.flash_attention``
  (no dropout), with its default ``BlockSizes`` (128 everywhere) and with blocks equal to our
  defaults (``attention._default_blocks``);
- ``torch math``: what a torch_xla user has today, ``F.scaled_dot_product_attention(q, k, v,
  dropout_p=0.1)`` on XLA tensors (torch's math path: it upcasts to float32, materialises the
  scores, the probabilities and the dropout mask), the torch_xla lazy graph of the output (and
  of ``out.backward(g)``) compiled by ``tpu_compile.compile_graph``.

Reported per generation: the whole program's schedule (``tpu_peers.program_schedule``: its top-level
program plus every fusion and kernel, each counted by ``torch_pallas.tpu_schedule.executed_schedule``, which follows
the kernels' branches: a flash step initialises and writes its output only at its first and last key
block, and causal steps above the diagonal skip their work), peak HBM (``peak_memory_in_bytes``), and
for the forward kernels the vector ops per score element by unit.
"""

from __future__ import annotations

import functools
import math
import sys
import time

import tpu_peers

import jax
import jax.numpy as jnp

from common import markdown_table
from torch_pallas import tpu_compile, tpu_schedule
from torch_pallas.kernels import attention
from torch_pallas.tpu_schedule import HARDWARE, executed_or_static_schedule, static_schedule

SHAPES = ((2, 8, 2048, 64), (2, 8, 2048, 128))
DTYPE = "bfloat16"
P = 0.1
KEY = jax.ShapeDtypeStruct((2,), jnp.int32)
# (name, dropout_p, impl) of our kernel.
OURS = (("ours p=0", 0.0, "threefry"), ("ours p=0.1 threefry", P, "threefry"), ("ours p=0.1 hardware", P, "hardware"),
        ("ours p=0.1 tiled", P, "tiled"))
JAX_FLASH = ("jax flash (default blocks)", "jax flash (our blocks)")
MATH = "torch math p=0.1"
PROGRAMS = tuple(name for name, _, _ in OURS) + JAX_FLASH + (MATH,)
PASSES = ("forward", "forward+backward")

UNITS = ("VALU", "EUP", "MXU", "XLU", "vld", "vst")


def unit_ops(run):
    """{unit: ops issued} of one executed_schedule result."""
    totals = dict.fromkeys(UNITS, 0)
    for count, ops in zip(run["counts"], run["ops"]):
        if count:
            for op in ops:
                unit = tpu_schedule.vector_unit(op)
                if unit:
                    totals[unit] += count
    return totals


# --- the programs ------------------------------------------------------------------------------------------------

def _ours(key, q, k, v, *, dropout_p, impl, causal):
    return attention.attention(key, q, k, v, None, dropout_p, impl, causal, None, False, False)


def _jax_flash(q, k, v, *, causal, block_sizes):
    from jax.experimental.pallas.ops.tpu import flash_attention as flash
    return flash.flash_attention(q, k, v, causal=causal, sm_scale=1.0 / math.sqrt(q.shape[-1]),
                                 block_sizes=block_sizes)


def _our_block_sizes():
    """JAX's BlockSizes equal to our default blocks (forward (q, kv), backward (q, kv))."""
    from jax.experimental.pallas.ops.tpu import flash_attention as flash
    forward = attention._default_blocks(interpret=False, backward=False)
    backward = attention._default_blocks(interpret=False, backward=True)
    return flash.BlockSizes(block_q=forward.q, block_k_major=forward.kv, block_k=forward.kv, block_b=1,
                            block_q_major_dkv=backward.q, block_k_major_dkv=backward.kv, block_k_dkv=backward.kv,
                            block_q_dkv=backward.q, block_k_major_dq=backward.kv, block_k_dq=backward.kv,
                            block_q_dq=backward.q)


def _vjp(forward):
    """The forward+backward program of ``forward(q, k, v)``: the output and the three gradients."""
    def step(q, k, v, g):
        out, vjp = jax.vjp(forward, q, k, v)
        return (out, *vjp(g))
    return step


def jax_program(program, shape, causal, backward):
    """(function, argument specs) of one of our or JAX's programs."""
    spec = jax.ShapeDtypeStruct(shape, getattr(jnp, DTYPE))
    if program.startswith("ours"):
        _, dropout_p, impl = next(o for o in OURS if o[0] == program)

        def function(key, q, k, v, *g):
            forward = functools.partial(_ours, key, dropout_p=dropout_p, impl=impl, causal=causal)
            return _vjp(forward)(q, k, v, *g) if backward else forward(q, k, v)
        return function, (KEY, spec, spec, spec) + ((spec,) if backward else ())
    block_sizes = None if "default" in program else _our_block_sizes()
    if block_sizes is None:
        from jax.experimental.pallas.ops.tpu import flash_attention as flash
        block_sizes = flash.BlockSizes.get_default(*shape[:3], shape[2], shape[3])
    forward = functools.partial(_jax_flash, causal=causal, block_sizes=block_sizes)
    return (_vjp(forward) if backward else forward), (spec,) * (4 if backward else 3)


def torch_math_graphs(shape, causal):
    """{pass: output tensors} of torch's SDPA math path with dropout: the forward's lazy graph, then
    the same graph with ``out.backward(g)`` (torch_xla tensors on the CPU client; never run)."""
    import torch
    import torch.nn.functional as F
    import torch_xla

    device = torch_xla.device()
    dtype = getattr(torch, DTYPE)
    q, k, v = (torch.zeros(shape, dtype=dtype, device=device).requires_grad_() for _ in range(3))
    g = torch.zeros(shape, dtype=dtype, device=device)
    # Device data, not constants the compiler could fold: the graph's inputs, as in training.
    torch_xla.sync()
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=causal)
    graphs = {"forward": [out]}
    out.backward(g)
    graphs["forward+backward"] = [out, q.grad, k.grad, v.grad]
    return graphs


# --- one compile -------------------------------------------------------------------------------------------------

def measure(compile_program, generation):
    """Compiles (``compile_program()`` returns the peak HBM bytes) and reads the schedule of
    everything compiled: the whole program's bundles, and each Pallas kernel's run and ops."""
    with tpu_compile.compiler_dumps() as dumps:
        start = time.perf_counter()
        peak = compile_program()
        seconds = time.perf_counter() - start
    bundles, parts = tpu_peers.program_schedule(dumps, generation)
    kernels = [(label, *executed_or_static_schedule(dump, generation, name=label), _grid_trip(dump))
               for label, dump in tpu_schedule.kernel_dumps(dumps).items()]
    return dict(seconds=seconds, peak=peak, bundles=bundles, parts=parts,
                hbm=tpu_schedule.hbm_bytes(tpu_schedule.optimized_hlo(dumps)), kernels=kernels)


def _grid_trip(dump):
    """The kernel's grid steps, or ``None`` where static_schedule cannot read its loops (as estimate)."""
    try:
        return static_schedule(dump)["grid_trip"]
    except (StopIteration, ValueError):
        return None


def _compile_jax(function, args, generation):
    compiled = tpu_compile.compile_for_tpu(function, *args, generation=generation)
    return compiled.runtime_executable().get_compiled_memory_stats().peak_memory_in_bytes


def _grid_steps(program, shape, causal):
    """Grid steps of the forward kernel (for the elements one TensorCore computes)."""
    B, H, L, E = shape
    if program.startswith("jax"):
        q = kv = 128 if "default" in program else None
        if q is None:
            blocks = attention._default_blocks(interpret=False, backward=False)
            q, kv = blocks.q, blocks.kv
    else:
        impl = next(o for o in OURS if o[0] == program)[2]
        problem = attention.resolve_problem((B, H, L, E), (B, H, L, E), (B, H, L, E))
        blocks = attention.resolve_blocks(None, problem, impl=impl, interpret=False)
        q, kv = blocks.q, blocks.kv
    return B * H * math.ceil(L / q) * math.ceil(L / kv)


# --- the section ---------------------------------------------------------------------------------------------------

def run(generations):
    """Measures every program and returns the section's markdown."""
    results = {}  # (shape, causal, pass, program, generation) -> measure()
    errors = {}
    for shape in SHAPES:
        for causal in (False, True):
            math_graphs = torch_math_graphs(shape, causal)
            for backward, pass_name in enumerate(PASSES):
                for program in PROGRAMS:
                    for generation in generations:
                        label = (shape, causal, pass_name, program, generation)
                        if program == MATH:
                            def compile_program(outputs=math_graphs[pass_name], generation=generation):
                                return tpu_compile.compile_graph(outputs, generation).peak_bytes
                        else:
                            function, args = jax_program(program, shape, causal, bool(backward))

                            def compile_program(function=function, args=args, generation=generation):
                                return _compile_jax(function, args, generation)
                        try:
                            results[label] = measure(compile_program, generation)
                        except Exception as error:  # the tables report what libtpu (or the reader) said
                            errors[label] = str(error).splitlines()[0][:200]
                            print("failed:", *label, errors[label], file=sys.stderr, flush=True)
                            continue
                        r = results[label]
                        print(shape, "causal" if causal else "", pass_name, program, generation,
                              f"{r['seconds']:.1f} s, {r['bundles']} bundles", file=sys.stderr, flush=True)
            del math_graphs
    return report(results, errors, generations)


def _us(bundles, generation):
    return bundles / HARDWARE[generation].clock * 1e6


def report(results, errors, generations):
    lines = []

    def cell(label, text):
        if label in errors:
            return "rejected: " + errors[label][:60]
        return text(results[label]) if label in results else "—"

    def rows_for(pass_name):
        rows = []
        for shape in SHAPES:
            for causal in (False, True):
                for program in PROGRAMS:
                    rows.append([str(shape), "yes" if causal else "no", program] + [
                        cell((shape, causal, pass_name, program, g), lambda r, g=g: f"{_us(r['bundles'], g):.0f}")
                        for g in generations])
        return rows

    for pass_name in PASSES:
        lines.append(f"**Schedule, {pass_name}** (µs: the whole program's bundles / clock; per TensorCore; "
                     "DMA waits not included).\n")
        lines.append(markdown_table(["(B, H, L, E)", "causal", "program", *generations], rows_for(pass_name)))
        lines.append("")

    # Ratios: ours at p=0 against JAX's flash attention (default blocks, and ours), the dropout's extra.
    def bound_us(r, g):
        """max(schedule, HBM time): the program's time if nothing else stalls it."""
        return max(_us(r["bundles"], g), r["hbm"] / HARDWARE[g].hbm_bandwidth * 1e6)

    def ratio(shape, causal, pass_name, a, b, g, percent=False, bound=False):
        la, lb = (shape, causal, pass_name, a, g), (shape, causal, pass_name, b, g)
        if la not in results or lb not in results:
            return "—"
        if bound:
            x = bound_us(results[la], g) / bound_us(results[lb], g)
        else:
            x = results[la]["bundles"] / results[lb]["bundles"]
        return f"{(x - 1) * 100:+.0f} %" if percent else f"{x:.2f}"

    rows = []
    for shape in SHAPES:
        for causal in (False, True):
            for pass_name in PASSES:
                key = [str(shape), "yes" if causal else "no", pass_name]
                rows.append(key + ["ours p=0 / jax flash default"] + [
                    ratio(shape, causal, pass_name, OURS[0][0], JAX_FLASH[0], g) for g in generations])
                rows.append(key + ["ours p=0 / jax flash, our blocks"] + [
                    ratio(shape, causal, pass_name, OURS[0][0], JAX_FLASH[1], g) for g in generations])
                rows.append(key + ["p=0.1 threefry over p=0"] + [
                    ratio(shape, causal, pass_name, OURS[1][0], OURS[0][0], g, True) for g in generations])
                rows.append(key + ["p=0.1 hardware over p=0"] + [
                    ratio(shape, causal, pass_name, OURS[2][0], OURS[0][0], g, True) for g in generations])
                rows.append(key + ["ours p=0.1 hardware / torch math p=0.1"] + [
                    ratio(shape, causal, pass_name, OURS[2][0], MATH, g) for g in generations])
                rows.append(key + ["the same, max(schedule, HBM time)"] + [
                    ratio(shape, causal, pass_name, OURS[2][0], MATH, g, bound=True) for g in generations])
    lines.append("**Ratios of the schedules above** (whole programs; the last row of each group compares "
                 "max(schedule, HBM time), HBM time as in the peak table below: the math path moves its "
                 "L x S matrices through HBM, the flash kernels do not).\n")
    lines.append(markdown_table(["(B, H, L, E)", "causal", "pass", "ratio", *generations], rows))
    lines.append("")

    rows = []
    for shape in SHAPES:
        for causal in (False, True):
            for program in PROGRAMS:
                rows.append([str(shape), "yes" if causal else "no", program] + [
                    cell((shape, causal, "forward+backward", program, g),
                         lambda r, g=g: f"{r['peak'] / 2**20:.0f} / {r['hbm'] / 2**20:.0f} / "
                                        f"{r['hbm'] / HARDWARE[g].hbm_bandwidth * 1e6:.0f}")
                    for g in generations])
    lines.append("**Peak HBM, forward+backward**: peak MiB (`peak_memory_in_bytes` of the compiled program: inputs "
                 "(key,) q, k, v, the output's gradient; outputs the output and q, k, v's gradients) / MiB the "
                 "optimised HLO moves to and from HBM (`tpu_schedule.hbm_bytes`: each fusion's and kernel's HBM "
                 "operands and results once; a flash kernel re-reads K and V once per query block, which this "
                 "leaves out where they are in HBM) / that at the published bandwidth, µs.\n")
    lines.append(markdown_table(["(B, H, L, E)", "causal", "program", *generations], rows))
    lines.append("")

    # What the forward kernels spend: ops per score element by unit (non-causal).
    rows = []
    for shape in SHAPES:
        B, H, L, E = shape
        for generation in generations:
            for program in PROGRAMS[:-1]:
                label = (shape, False, "forward", program, generation)
                if label not in results or not results[label]["kernels"]:
                    continue
                name, run, followed, trip = results[label]["kernels"][0]
                steps = _grid_steps(program, shape, False)
                cores = max(1, round(steps / trip)) if trip else 1
                per = 1024 / (B * H * L * L / cores)  # per score element: a vector op acts on 1024 32-bit lanes
                units = unit_ops(run) if followed else {}
                rows.append([str(shape), generation, program, f"{cores}",
                             f"{run['bundles'] * per:.2f}" + ("" if followed else " (static)"),
                             f"{_us(run['bundles'], generation):.0f}"]
                            + [f"{units[u] * per:.2f}" if followed else "—" for u in UNITS])
    lines.append("**The forward kernels, per 1024 score elements** (non-causal; ops issued per TensorCore "
                 "divided by the B·H·L·S / cores score elements it computes, x 1024: one vector op acts "
                 "on 8 x 128 32-bit lanes): bundles (the schedule), and vector ops by unit. VALU: the "
                 "vector ALUs (4 slots per bundle, 2 on v4); EUP: transcendental pushes and result pops "
                 "(exp); MXU: matrix pushes, matmuls and result pops; XLU: permutes and lane reductions; "
                 "vld / vst: VMEM loads and stores. A kernel whose branches depend on data (which "
                 "`executed_schedule` cannot follow) shows its static schedule, every conditional region "
                 "counted, marked (static), and no units.\n")
    lines.append(markdown_table(["(B, H, L, E)", "gen", "kernel", "cores", "bundles", "kernel µs", *UNITS], rows))
    lines.append("")
    if errors:
        lines.append("Failures: " + "; ".join(f"{' '.join(map(str, k))}: {v}" for k, v in errors.items()))
    return "\n".join(lines)
