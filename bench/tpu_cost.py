"""What the TPU compiler says each kernel costs at 2**22 elements, on a machine without a TPU.

    .venv/bin/python bench/tpu_cost.py                 # markdown tables on stdout
    .venv/bin/python bench/tpu_cost.py --only dropout  # kernels whose name starts with this
    .venv/bin/python bench/tpu_cost.py --what-if       # also the hardware PRNG seeded per smaller tiles
    .venv/bin/python bench/tpu_cost.py --only attention  # the flash-attention rows alone (bench/tpu_cost_attention.py)

Each kernel (dropout, which is also its own backward; uniform / normal / bernoulli sampling; the
IndRNN forward and backward), dtype (float32, bfloat16), noise impl (threefry, hardware) and TPU
generation (v4, v5e, v5p, v6e) is compiled with the library's default blocks by libtpu's
compile-only client (torch_pallas.tpu_compile, interpret=False). Reported:

- compile time; ``compiled.memory_analysis()`` (argument / output / temp bytes, generated code
  size); ``compiled.cost_analysis()`` (flops, bytes accessed);
- from libtpu's own dump of the kernel's final VLIW bundles (``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR
  --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=final_bundles``): the static
  schedule. Every loop's bundles are counted once per iteration (its trip count read from its
  ``loop exit test``); the grid loop's two pipeline stages that skip the body are left out. This
  gives the kernel's bundle count (= cycles if nothing stalls) per TensorCore, and its vector-ALU
  operations (``v*`` ops but loads, stores, syncs, vrng and the EUP's push/pop) per element;
- the roofline: HBM bytes (from the BlockSpecs) at the published bandwidth vs the schedule's cycles
  at the clock (constants in HARDWARE).

Nothing runs on a TPU: the cycle counts are the compiler's schedule, not measurements, and DMA
waits (the HBM-bound part) are not in them.

The attention rows (``--only attention``; ``bench/tpu_cost_attention.py``) and the whole programs of
``bench/tpu_peers.py`` count bundles with ``executed_schedule`` instead, which runs each kernel's (and
XLA fusion's) scalar control flow so that regions under ``pl.when`` count as often as they run (it
agrees with ``static_schedule`` within 1 % on the kernels above, which branch only around their
pipeline's first and last steps).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import glob
import importlib.metadata
import itertools
import math
import os
import re
import shutil
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="tpu_cost_llo_")
atexit.register(shutil.rmtree, DUMP, ignore_errors=True)
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Read when libtpu initialises, i.e. at the first compile below.
os.environ["LIBTPU_INIT_ARGS"] = " ".join(filter(None, [
    os.environ.get("LIBTPU_INIT_ARGS"), f"--xla_jf_dump_to={DUMP}", "--xla_jf_dump_llo_text=true",
    "--xla_jf_dump_llo_pass_label_regex=final_bundles"]))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_pallas  # noqa: E402,F401  (torch_xla before JAX; pins the Mosaic IR version libtpu accepts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import markdown_table  # noqa: E402
from torch_pallas import tpu_compile  # noqa: E402
from torch_pallas.kernels import dropout, indrnn, sampling, tiling  # noqa: E402

N = 2**22
VIEW = (4096, 1024)         # 2**22 elements, the 2-D view every elementwise kernel uses at this size
T, B, F = 1024, 8, 512      # 2**22 elements; default blocks (64, 8, 512)
KEY = jax.ShapeDtypeStruct((2,), jnp.int32)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Vector ops that use no vector-ALU slot: VMEM loads/stores, syncs, phis, mask moves, the hardware
# PRNG's draw (vrng: bundled with four VALU ops), the EUP's transcendental pushes and result pops.
NOT_VALU = re.compile(r"v(ld|st|syncpa|syncadd|pop\.eup|phi|mmov|rng)|v(rcp|rsqrt|log2|exp2?|pow2?|tanh|sin|cos)\.f32")


# HBM bandwidth (bytes/s; published, Cloud TPU system-architecture pages), clock (Hz; v5e and v5p
# published in "How to Scale Your Model", v4 and v6e derived from peak bf16 FLOP/s) and vector ALUs
# per (sublane, lane), i.e. VALU slots per bundle (v4 and v5p published there; all four read off the
# bundles below). Sources and derivations: bench/results/tpu_cost.md.
HARDWARE = {
    "v4": dict(hbm=1200e9, clock=1.05e9, valus=2),
    "v5e": dict(hbm=819e9, clock=1.5e9, valus=4),
    "v5p": dict(hbm=2765e9, clock=1.75e9, valus=4),
    "v6e": dict(hbm=1640e9, clock=1.75e9, valus=4),
}


def _elementwise_grid(itemsize, impl):
    blocks = tiling.resolve_elementwise(None, *VIEW, itemsize, interpret=False,
                                        seed_tile=tiling.hardware_tile(*VIEW) if impl == "hardware" else None)
    return math.ceil(VIEW[0] / blocks.rows) * math.ceil(VIEW[1] / blocks.cols)


def configurations():
    """Every kernel at 2**22 elements with default blocks: its name, dtype, impl, grid size, the
    HBM bytes its BlockSpecs move (read + write), and the function and arguments to compile."""
    for dtype_name, dtype in DTYPES.items():
        size = jnp.dtype(dtype).itemsize
        for impl in ("threefry", "hardware"):
            # Reads x, writes y (the backward: reads the gradient, writes grad_x); the key is 8 bytes.
            yield dict(kernel="dropout", dtype=dtype_name, impl=impl, grid=_elementwise_grid(size, impl),
                       bytes=2 * N * size + 8, args=(KEY, jax.ShapeDtypeStruct(VIEW, dtype)),
                       function=functools.partial(dropout.dropout, p=0.1, impl=impl, interpret=False))
            for distribution in ("uniform", "normal") + (("bernoulli",) if dtype_name == "float32" else ()):
                bernoulli = distribution == "bernoulli"  # the kernel writes int32; a cast to bool follows it
                out_size = 4 if bernoulli else size
                yield dict(kernel=distribution, dtype="bool (int32)" if bernoulli else dtype_name, impl=impl,
                           grid=_elementwise_grid(out_size, impl), bytes=N * out_size + 8, args=(KEY,),
                           function=functools.partial(sampling.sample, shape=VIEW, distribution=distribution,
                                                      dtype=dtype, p=0.3, impl=impl, interpret=False))
        sequence, state = jax.ShapeDtypeStruct((T, B, F), dtype), jax.ShapeDtypeStruct((B, F), dtype)
        weight = jax.ShapeDtypeStruct((F,), jnp.float32)
        blocks = tiling.resolve_recurrence(None, T, B, F, dtype, interpret=False)
        time_blocks = math.ceil(T / blocks.time)
        grid = time_blocks * math.ceil(B / blocks.batch) * math.ceil(F / blocks.features)
        # The kernels' own cost_estimates: forward reads x, writes output (+ h0, h_n, the weight row);
        # backward reads grad_output and output, writes grad_x (+ one output row per time block, h0,
        # grad_h_n, grad_h0 and the float32 weight-gradient rows).
        forward_bytes = 2 * N * size + 2 * B * F * size + F * 4
        backward_bytes = (3 * N + time_blocks * B * F + 3 * B * F) * size + 4 * B * F
        for nonlinearity in indrnn.NONLINEARITIES:
            options = dict(nonlinearity=nonlinearity, interpret=False)
            yield dict(kernel=f"indrnn_forward {nonlinearity}", dtype=dtype_name, impl="-", grid=grid,
                       bytes=forward_bytes, args=(sequence, weight, state),
                       function=functools.partial(indrnn.indrnn_forward, **options))
            yield dict(kernel=f"indrnn_backward {nonlinearity}", dtype=dtype_name, impl="-", grid=grid,
                       bytes=backward_bytes, args=(sequence, state, sequence, weight, state),
                       function=functools.partial(indrnn.indrnn_backward, **options))


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
                tile, grid = tiling.hardware_tile(*VIEW), _elementwise_grid(jnp.dtype(dtype).itemsize, "hardware")

            def function(key, x, elements=elements):
                with hardware_tile_elements(elements):
                    return dropout.dropout(key, x, p=0.1, impl="hardware", interpret=False)
            yield dict(kernel=f"dropout, hardware PRNG per {tile} tile (what-if)", dtype=dtype_name, impl="hardware",
                       grid=grid, bytes=2 * N * jnp.dtype(dtype).itemsize + 8, function=function,
                       args=(KEY, jax.ShapeDtypeStruct(VIEW, dtype)))


# --- the static schedule, from libtpu's final-bundles dump -------------------------------------------------------

_BUNDLE = re.compile(r"\s*(0x[0-9a-f]+|\d+)\s+([A-Z]{2})?:\s*(>*)\s*\{(.*)$")


def _bundles(path):
    """[(loop depth, starts a loop body, ops, text)] of one final_bundles dump, in address order."""
    bundles = []
    for line in open(path):
        match = _BUNDLE.match(line)
        if match:
            ops = re.findall(r"= ([a-z][a-z0-9_.]*)", match.group(4))
            bundles.append((len(match.group(3)), match.group(2) == "LB", ops, line))
    return bundles


def _loops(bundles):
    """(first, last, trip) bundle index ranges of the loops. A loop's "loop exit test" compare (its
    constant is the trip count) sets the predicate of the branch that closes it; the body starts
    at the nearest "LB" (loop body) bundle of the test's nesting depth and ends with the branch's
    delay slots (through the bundle marked "End region")."""
    loops = []
    for i, (_, _, _, text) in enumerate(bundles):
        test = re.search(r"(%p[0-9a-z_]+) = scmp\.[a-z.0-9]+ %s[0-9a-z_]+, (\d+) /\* loop exit test", text)
        if not test:
            continue
        branch = next(j for j in range(i, len(bundles)) if f"sbr.rel (!{test.group(1)})" in bundles[j][3])
        first = max(j for j in range(i + 1) if bundles[j][1] and bundles[j][0] == bundles[i][0])
        last = next((j for j in range(branch, min(branch + 5, len(bundles))) if "End region" in bundles[j][3]), branch)
        loops.append((first, last, int(test.group(2))))
    return sorted(loops)


def static_schedule(path):
    """Bundles (cycles if nothing stalls) and vector-ALU ops of one kernel run on one TensorCore,
    and the number of grid steps it runs."""
    bundles = _bundles(path)
    loops = _loops(bundles)
    valu = [sum(1 for op in ops if op.startswith("v") and not NOT_VALU.fullmatch(op)) for _, _, ops, _ in bundles]
    # The grid loop (the outermost) runs two more iterations than grid steps, the pipeline's first
    # copy-in and last copy-out, which branch around the body: count the body grid-steps times.
    outermost = [loop for loop in loops if not any(o[0] <= loop[0] and loop[1] <= o[1] and o != loop for o in loops)]
    grid_steps = outermost[0][2] - 2 if len(outermost) == 1 else None

    def cost(first, last):
        """(bundles, valu ops) of one pass over bundles first..last, each inner loop trip times."""
        cycles = ops = 0
        i = first
        while i <= last:
            inner = next((loop for loop in loops
                          if loop[0] == i and loop[1] <= last and (loop[0], loop[1]) != (first, last)), None)
            if inner is None:
                cycles, ops, i = cycles + 1, ops + valu[i], i + 1
                continue
            trip = grid_steps if grid_steps is not None and inner == outermost[0] else inner[2]
            body_cycles, body_ops = cost(inner[0], inner[1])
            cycles, ops, i = cycles + trip * body_cycles, ops + trip * body_ops, inner[1] + 1
        return cycles, ops

    cycles, ops = cost(0, len(bundles) - 1)
    return {"bundles": cycles, "valu_ops": ops, "grid_trip": grid_steps, "max_valu_per_bundle": max(valu)}


# --- the executed schedule: the scalar unit's control flow, run -------------------------------------------------
#
# static_schedule counts every bundle of a loop body once per iteration, the bodies of `pl.when` regions
# included. That is exact for the elementwise kernels (no conditional regions) but not for kernels whose
# grid steps branch: a flash-attention step initialises its accumulators only at the first key block,
# writes its output only at the last, and (causal) skips blocks above the diagonal. executed_schedule
# follows the kernel's control flow instead: it runs the bundles' scalar ops (the sequencer's integer and
# predicate arithmetic, SMEM spills; all of them are functions of the grid indices) and takes each branch
# as the hardware would, counting how many times each bundle issues.

_MASK32 = 2**32 - 1
# Bundles that issue after a branch before it takes effect: 1 on v4, 4 on v5e, v5p and v6e (read off the
# dumps: the bundles after a branch hold the region's ops predicated on the branch's negation).
BRANCH_DELAY_SLOTS = {"v4": 1, "v5e": 4, "v5p": 4, "v6e": 4}
_OP = re.compile(r"(?:%(?:[sp]\d+_([sp]\d+)|[\w.]+) = )?([a-z_][\w.]*)\s*(.*)")
_PREDICATE = re.compile(r"\((!?)%p\w*_(p\d+)(?:, %\w+)?\)\s*,?\s*")
_SIGNED = lambda x: x - 2**32 if x >= 2**31 else x  # noqa: E731
_BINARY = {
    "sadd.s32": lambda a, b: (a + b) & _MASK32, "ssub.s32": lambda a, b: (a - b) & _MASK32,
    "smul.u32": lambda a, b: (a * b) & _MASK32, "sand.u32": lambda a, b: a & b, "sor.u32": lambda a, b: a | b,
    "sxor.u32": lambda a, b: a ^ b, "sshll.u32": lambda a, b: (a << (b & 31)) & _MASK32,
    "sshrl.u32": lambda a, b: a >> (b & 31), "sshra.s32": lambda a, b: (_SIGNED(a) >> (b & 31)) & _MASK32,
    "pnand": lambda a, b: not (a and b), "por": lambda a, b: bool(a or b), "pand": lambda a, b: bool(a and b),
}
for _name, _compare in (("eq", lambda a, b: a == b), ("ne", lambda a, b: a != b), ("lt", lambda a, b: a < b),
                        ("le", lambda a, b: a <= b), ("gt", lambda a, b: a > b), ("ge", lambda a, b: a >= b)):
    _BINARY[f"scmp.{_name}.s32.totalorder"] = lambda a, b, c=_compare: c(_SIGNED(a), _SIGNED(b))
    _BINARY[f"scmp.{_name}.u32.totalorder"] = _compare


def _operand(text):
    """('reg', name) / ('imm', value) / ('mem', address text) / ('?', text) of one operand."""
    text = re.sub(r"/\*.*?\*/", "", text).strip()
    register = re.fullmatch(r"%[sp]\w*_([sp]\d+)", text)
    if register:
        return ("reg", register.group(1))
    if re.fullmatch(r"-?\d+", text):
        return ("imm", int(text) & _MASK32)
    memory = re.fullmatch(r"\[smem:\[(.*)\]\]", text)
    if memory:
        return ("mem", memory.group(1))
    return ("?", text)


def _scalar_ops(text):
    """The ops of one bundle the interpreter runs: (dest register or None, op, predicate (negated,
    register) or None, operands); a branch as ("sbr", predicate, region)."""
    ops = []
    for raw in text[text.index("{") + 1:].split(";;"):
        op_text = re.sub(r"/\*(?!predicate=|on_true=|on_false=).*?(\*/|$)", "", raw).strip()
        if op_text.endswith("}"):
            op_text = op_text[:-1].strip()
        match = _OP.match(op_text)
        if not match:
            continue
        dest, name, rest = match.groups()
        if name == "sld" and "/* core id */" in raw:
            # The TensorCore's index (v5p's megacore splits "parallel" grids over two): count core 0's work.
            ops.append((dest, "smov", None, [("imm", 0)]))
            continue
        if name.startswith(("v", "dma", "int_to_ptr")) or name in ("sphi", "shalt.err", "sfence"):
            # Vector and DMA ops; phis are copies into the same physical register after allocation, and
            # int_to_ptr retypes the register it reads (it shares a bundle with the op that wrote it).
            continue
        predicate = None
        guard = _PREDICATE.match(rest)
        if guard:
            predicate, rest = (guard.group(1) == "!", guard.group(2)), rest[guard.end():]
        else:  # a predicate may also follow the operands: sld [smem:[...]] (%p1_p13)
            guard = re.search(r"\s*\((!?)%p\w*_(p\d+)\)\s*$", rest)
            if guard:
                predicate, rest = (guard.group(1) == "!", guard.group(2)), rest[:guard.start()]
        if name == "sbr.rel":
            target = re.search(r"target bundleno = (\d+) .*region = (\d+)", rest)
            ops.append(("sbr", predicate, (int(target.group(1)), int(target.group(2)))))
            continue
        if name == "scalar_select":
            parts = re.findall(r"/\*(?:predicate|on_true|on_false)=\*/\s*([^,]+)", rest)
            ops.append((dest, name, predicate, [_operand(p) for p in parts]))
            continue
        if dest is None and name != "sst":
            continue
        if name == "sst":
            address, value = re.match(r"(\[smem:\[.*?\]\])\s*(.*)", rest).groups()
            ops.append((None, name, predicate, [_operand(address), _operand(value)]))
            continue
        ops.append((dest, name, predicate, [_operand(p) for p in rest.split(",")] if rest.strip() else []))
    return ops


def _address(operand, registers):
    """An SMEM address's key: its allocation text, with a register's value where it has one."""
    text = operand[1]
    register = re.fullmatch(r"%[sp]\w*_([sp]\d+)(.*)", text)
    if register:
        value = registers.get(register.group(1))
        return None if value is None else f"{value}{register.group(2)}"
    return text


def executed_schedule(path, delay_slots):
    """Bundles issued by one run of a compiled kernel (or XLA fusion), following its control flow:
    the scalar unit's ops are interpreted (integer arithmetic, compares, predicates, SMEM spills),
    branches taken as their predicates say after ``delay_slots`` bundles. Values the sequencer reads
    from outside (operand addresses, key words in SMEM, vector results popped to scalars) are unknown;
    a branch on an unknown value raises ValueError (none of the kernels here has one).

    Returns {"bundles": total issued, "counts": issues per bundle (in dump order), "ops": [op names per
    bundle]}."""
    bundles = _bundles(path)
    texts = [text for _, _, _, text in bundles]
    n = len(bundles)
    # A branch names the region it goes to: a branch back, the loop whose head starts that region (an
    # "LB" bundle, "Start region N"); a branch forward, around a skipped region, the empty region that
    # marks where it lands ("Start/End empty region N", a "PF" bundle). (Its "bundleno" is not the dump's
    # bundle index: it counts instruction words, and long bundles take more than one.)
    marks = {}
    for i, text in enumerate(texts):
        for region in re.findall(r"Start(?:/End empty)? region (\d+)\b", text):
            marks.setdefault(int(region), []).append(i)

    def target_of(pc, bundleno, region):
        candidates = marks.get(region, [])
        back = [i for i in candidates if i <= pc and bundles[i][1]]
        forward = [i for i in candidates if i > pc]
        if bundleno <= int(texts[pc].split()[0], 0) and back:
            return back[-1]
        if bundleno > int(texts[pc].split()[0], 0) and forward:
            return forward[0]
        if bundleno > int(texts[pc].split()[0], 0) and "exit bundle" in texts[-1]:
            return n - 1  # a branch to the program's end (v5p: the second TensorCore skipping a fusion)
        raise ValueError(f"{os.path.basename(path)}: no target for the branch at bundle {pc} (bundle number "
                         f"{bundleno}, region {region})")

    program = [_scalar_ops(text) for text in texts]
    interesting = [bool(ops) for ops in program]
    next_interesting = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        next_interesting[i] = i if interesting[i] else next_interesting[i + 1]
    registers, memory = {}, {}
    difference = [0] * (n + 1)
    pc, pending, issued = 0, None, 0

    def value(operand):
        kind, content = operand
        if kind == "imm":
            return content
        if kind == "reg":
            return registers.get(content)
        return None

    steps = 0
    while pc < n:
        steps += 1
        if steps > 10**8:
            raise ValueError(f"{os.path.basename(path)}: still running after 10^8 interpreted bundles")
        if pending is None and not interesting[pc]:
            # Straight through the bundles that hold no scalar op.
            stop = next_interesting[pc]
            difference[pc] += 1
            difference[stop] -= 1
            issued += stop - pc
            pc = stop
            if pc >= n:
                break
        difference[pc] += 1
        difference[pc + 1] -= 1
        issued += 1
        writes, branch = [], None
        for op in program[pc]:
            if op[0] == "sbr":
                _, predicate, region = op
                taken = True
                if predicate is not None:
                    flag = registers.get(predicate[1])
                    if flag is None:
                        raise ValueError(f"{os.path.basename(path)}: the branch at bundle {pc} depends on an unknown "
                                         f"predicate ({predicate[1]})")
                    taken = (not flag) if predicate[0] else bool(flag)
                branch = (taken, target_of(pc, *region) if taken else None)
                continue
            dest, name, predicate, operands = op
            if predicate is not None:
                flag = registers.get(predicate[1])
                if flag is None:
                    if dest is not None:
                        writes.append((dest, None))
                    continue
                if flag == predicate[0]:  # (!p) with p true, or (p) with p false: the op does not issue
                    continue
            if name == "sst":
                address = _address(operands[0], registers)
                if address is not None:
                    writes.append((("mem", address), value(operands[1])))
                continue
            if name == "sld":
                address = _address(operands[0], registers) if operands[0][0] == "mem" else None
                result = memory.get(address)
            elif name in ("smov", "pmov"):
                result = value(operands[0]) if operands else None
            elif name == "pneg":
                flag = value(operands[0])
                result = None if flag is None else not flag
            elif name == "scalar_select":
                flag, on_true, on_false = (value(o) for o in operands)
                result = None if flag is None else (on_true if flag else on_false)
            elif name in _BINARY and len(operands) == 2:
                a, b = value(operands[0]), value(operands[1])
                result = None if a is None or b is None else _BINARY[name](a, b)
            else:
                result = None  # addresses, pops from vector units, parameters: not needed for control flow
            writes.append((dest, result))
        for dest, result in writes:
            if isinstance(dest, tuple):
                memory[dest[1]] = result
            else:
                registers[dest] = result
        if pending is not None:
            pending[0] -= 1
        if branch is not None:
            if pending is not None:
                raise ValueError(f"{os.path.basename(path)}: a branch in another branch's delay slots at bundle {pc}")
            pending = [delay_slots, *branch]
        pc += 1
        if pending is not None and pending[0] == 0:
            _, taken, target = pending
            pending = None
            if taken:
                pc = target
        elif pending is not None and pending[0] > 0 and pc >= n:
            break
    counts, running = [], 0
    for i in range(n):
        running += difference[i]
        counts.append(running)
    return {"bundles": issued, "counts": counts, "ops": [ops for _, _, ops, _ in bundles]}


def kernel_dumps(before):
    """The final_bundles dumps of the Pallas kernels (custom calls) compiled since ``before``."""
    new = sorted(set(glob.glob(os.path.join(DUMP, "*final_bundles.txt"))) - before)
    return [path for path in new if "schedule-analysis" not in path and "-TLP-" not in path
            and "= custom-call(" in open(path).read()]


# --- one compile ------------------------------------------------------------------------------------------------

def measure(function, args, generation):
    before = set(glob.glob(os.path.join(DUMP, "*")))
    start = time.perf_counter()
    compiled = tpu_compile.compile_for_tpu(function, *args, generation=generation)
    seconds = time.perf_counter() - start
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    schedules = [static_schedule(path) for path in kernel_dumps(before)]
    return {
        "compile_s": seconds, "memory": memory, "cost": cost,
        "serialized_bytes": len(compiled.runtime_executable().serialize()), "hlo_text_chars": len(compiled.as_text()),
        "bundles": sum(s["bundles"] for s in schedules), "valu_ops": sum(s["valu_ops"] for s in schedules),
        "grid_steps": schedules[0]["grid_trip"],
        "max_valu_per_bundle": max(s["max_valu_per_bundle"] for s in schedules),
    }


def _cost_bytes(cost):
    """XLA's "bytes accessed": its total where the kernel has a cost_estimate (IndRNN); a Pallas call
    without one is missing from the total, so then the sum of its operands' and outputs' sizes."""
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
    options = parser.parse_args()
    if not tpu_compile.available():
        sys.exit("libtpu (the TPU compiler) is not installed")
    selected = [c for c in itertools.chain(configurations(), what_if_configurations() if options.what_if else ())
                if not options.only or c["kernel"].startswith(options.only)]
    if selected:
        elementwise_and_recurrence(selected, options)
    if not options.only or "attention".startswith(options.only):
        import tpu_cost_attention
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
        for generation in options.generations:
            try:
                r = measure(c["function"], c["args"], generation)
            except Exception as error:  # the table reports what libtpu said
                compile_cells.append("rejected: " + str(error).splitlines()[0][:80])
                roofline_cells.append("—")
                continue
            m, hw = r["memory"], HARDWARE[generation]
            # The grid loop ran grid / cores steps: 2 where the compiler split the "parallel" grid over a
            # megacore's two TensorCores, each then doing half the elements.
            cores = c["grid"] // r["grid_steps"] if r["grid_steps"] else 1
            valu_per_element = r["valu_ops"] * 1024 / (N / cores)    # vector ops act on 8 x 128 32-bit lanes
            bundles_per_vreg = r["bundles"] * 1024 / (N / cores)
            memory_us = c["bytes"] / hw["hbm"] * 1e6
            valu_us = r["valu_ops"] / (hw["valus"] * hw["clock"]) * 1e6
            schedule_us = r["bundles"] / hw["clock"] * 1e6
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
                flops, f"{cost_bytes:.0f}", f"{c['grid']} / {cores}", f"{valu_per_element:.0f}",
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
    command = "bench/tpu_cost.py" + (" --what-if" if options.what_if else "")
    print(f"Generated by `.venv/bin/python {command}` (libtpu {libtpu}'s "
          f"compile-only client, jax {jax.__version__}); {N} elements: elementwise view {VIEW}, IndRNN (T, B, F) = "
          f"{(T, B, F)}; the library's default blocks. Nothing ran on a TPU.\n")
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
    # tpu_peers and tpu_cost_attention import this module: let them find this instance (its DUMP).
    sys.modules.setdefault("tpu_cost", sys.modules[__name__])
    main()
