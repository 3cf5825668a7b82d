"""Whole-program TPU time estimates read off libtpu's compiled code, on a machine without a TPU.

libtpu's compile-only client (:mod:`torch_pallas.tpu_compile`) compiles a program for a real TPU
generation; asked to (``tpu_compile.enable_estimates()``, which sets ``LIBTPU_INIT_ARGS=
--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=final_bundles``
before libtpu initialises), it also writes the final VLIW bundles of every piece of code it
generated: the top-level program (``TLP``), each XLA fusion and each Mosaic kernel (a Pallas call,
an HLO ``custom-call``), and the optimised HLO. This module reads those dumps (pure Python: no
torch, no JAX):

- :func:`static_schedule`: one kernel's bundles with every loop counted per iteration;
- :func:`executed_schedule`: bundles issued by one run, following the scalar unit's control flow;
- :func:`executed_or_static_schedule`: that, or the static schedule where the control flow branches on data
  (what :func:`estimate` counts);
- :func:`hbm_bytes_by_instruction`: HBM bytes each instruction of the optimised HLO moves;
- :func:`estimate`: the whole program's time, a :class:`StepEstimate`;
- :data:`HARDWARE`: each generation's HBM bandwidth, clock, vector-ALU slots and branch delay slots.

A dump is the text of one file, and ``dumps`` a mapping of file names (as libtpu names them) to
texts, as ``tpu_compile.compiler_dumps()`` collects them. Nothing here runs on a TPU: bundle counts
are the compiler's schedule, not measurements.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One chip of a TPU generation, as the estimates use it.

    ``hbm_bandwidth`` is in bytes/s per chip, ``clock`` in Hz, ``valu_slots`` the vector-ALU ops
    one bundle can issue, ``branch_delay_slots`` the bundles that issue after a branch before it
    takes effect, ``tensor_cores`` the TensorCores of one device that split a kernel's
    ``"parallel"`` grid (a megacore's two). ``None``: not established (see :data:`HARDWARE`).
    """

    hbm_bandwidth: float
    clock: Optional[float]
    valu_slots: Optional[int]
    branch_delay_slots: Optional[int]
    tensor_cores: Optional[int]


# HBM bandwidth: published (Cloud TPU system-architecture pages). Clock: v5e and v5p published in
# "How to Scale Your Model", v4 and v6e derived from peak bf16 FLOP/s. VALU slots: v4 and v5p
# published there, all four read off the bundles. Sources and derivations: bench/results/tpu_cost.md.
# Branch delay slots read off the dumps (the bundles after a branch hold the region's ops
# predicated on the branch's negation): 1 on v4, 4 on v5e to v6e, 6 on TPU7x (libtpu 0.0.52).
# TPU7x's clock is not published (nor its MXUs per TensorCore, to derive it from peak FLOP/s),
# and its dumps word branches differently (no bundle numbers), which executed_schedule does not read.
# TensorCores: v4 and v5p are megacores (published), and their compiles split "parallel" grids over two
# (bench/tpu_cost.py's "2 TC"); v5e and v6e have one; TPU7x's two TensorCores are two devices.
HARDWARE = {
    "v4": Hardware(hbm_bandwidth=1200e9, clock=1.05e9, valu_slots=2, branch_delay_slots=1, tensor_cores=2),
    "v5e": Hardware(hbm_bandwidth=819e9, clock=1.5e9, valu_slots=4, branch_delay_slots=4, tensor_cores=1),
    "v5p": Hardware(hbm_bandwidth=2765e9, clock=1.75e9, valu_slots=4, branch_delay_slots=4, tensor_cores=2),
    "v6e": Hardware(hbm_bandwidth=1640e9, clock=1.75e9, valu_slots=4, branch_delay_slots=4, tensor_cores=1),
    "tpu7x": Hardware(hbm_bandwidth=7380e9, clock=None, valu_slots=None, branch_delay_slots=6, tensor_cores=1),
}


def _hardware(generation: str, *needed: str) -> Hardware:
    if generation not in HARDWARE:
        raise ValueError(f"generation must be one of {', '.join(map(repr, HARDWARE))}, got {generation!r}")
    hardware = HARDWARE[generation]
    missing = [name for name in needed if getattr(hardware, name) is None]
    if missing:
        raise NotImplementedError(f"{generation}: {', '.join(missing)} not established (unpublished, not read off "
                                  "its dumps), so its schedule cannot be turned into time; see "
                                  "torch_pallas.tpu_schedule.HARDWARE")
    return hardware


def valu_seconds(generation: str, ops: float) -> float:
    """The least time ``ops`` vector-ALU ops (each on one vreg of 8 x 128 32-bit lanes) take on
    one device of ``generation``: every VALU slot of every bundle of every TensorCore busy. A
    floor for vector work, as bytes over bandwidth are for memory traffic."""
    hardware = _hardware(generation, "clock", "valu_slots", "tensor_cores")
    return ops / (hardware.valu_slots * hardware.clock * hardware.tensor_cores)


# --- bundles -----------------------------------------------------------------------------------------------------

# Vector ops by the unit that executes them; every other vector op is the vector ALUs' ("VALU"). The
# matrix units (pushes, matmuls, result pops), the cross-lane units (permutes, lane reductions, their
# pops), the EUP's transcendentals (exp is vpow2 after a multiply by log2(e)) and their pops, VMEM
# loads and stores; ``None``: ops that issue in no ALU slot: syncs, phis, mask moves, the hardware
# PRNG's draw (vrng: bundled with four VALU ops), and logic on compare masks (vmor, vmand, vmpackc:
# beside a bundle's full VALU slots, e.g. v4's two ops and a vmand).
VECTOR_UNITS = (
    ("MXU", re.compile(r".*\.mxu\d.*|vmatmul.*|vmatpush.*|vlatch.*|vdwg.*")),
    ("XLU", re.compile(r".*\.xlu\d.*|vxpose.*")),
    ("EUP", re.compile(r"v(rcp|rsqrt|log2|exp2?|pow2?|tanh|sin|cos|erf)\.f32|vpop\.eup")),
    ("vld", re.compile(r"vld.*")), ("vst", re.compile(r"vst.*")),
    (None, re.compile(r"v(sync|phi|mmov|rng|trace|delay|set|nop|wait|setiar|mor|mand|mxor|mnot|mpack).*")))


def vector_unit(op: str) -> str | None:
    """The unit that executes bundle op ``op`` (:data:`VECTOR_UNITS`, else ``"VALU"``); ``None``
    for a scalar op or one that takes no ALU slot."""
    if not op.startswith("v"):
        return None
    for unit, pattern in VECTOR_UNITS:
        if pattern.fullmatch(op):
            return unit
    return "VALU"


_BUNDLE = re.compile(r"\s*(0x[0-9a-f]+|\d+)\s+([A-Z]{2})?:\s*(>*)\s*\{(.*)$")


def _bundles(dump):
    """[(loop depth, starts a loop body, ops, text)] of one final_bundles dump, in address order."""
    bundles = []
    for line in dump.splitlines():
        match = _BUNDLE.match(line)
        if match:
            ops = re.findall(r"= ([a-z][a-z0-9_.]*)", match.group(4))
            bundles.append((len(match.group(3)), match.group(2) == "LB", ops, line))
    return bundles


def bundle_count(dump: str) -> int:
    """The number of bundles in one final_bundles ``dump`` (each once: a straight-line program's run)."""
    return len(_bundles(dump))


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


def static_schedule(dump: str) -> dict:
    """The static schedule of one Mosaic kernel run on one TensorCore.

    Every loop's bundles are counted once per iteration (its trip count read from its ``loop
    exit test``); the grid loop's two pipeline stages that skip the body are left out.

    Args:
        dump: the kernel's final_bundles dump (its text).

    Returns:
        dict: ``"bundles"`` (cycles if nothing stalls), ``"valu_ops"`` (vector-ALU ops),
        ``"grid_trip"`` (grid steps run, or ``None`` without a single outermost loop) and
        ``"max_valu_per_bundle"``.
    """
    bundles = _bundles(dump)
    loops = _loops(bundles)
    valu = [sum(vector_unit(op) == "VALU" for op in ops) for _, _, ops, _ in bundles]
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

# A DMA's size_in_granules counts 32-byte HBM granules: a (256, 1024) float32 block is 32768 of them,
# and an s32[2] key, padded to its (128,) tile, 16.
HBM_GRANULE_BYTES = 32
_MASK32 = 2**32 - 1
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
        if name == "sld" and "core id */" in raw:  # libtpu 0.0.52: "/* megacore core id :: core id */"
            # The TensorCore's index (v5p's megacore splits "parallel" grids over two): count core 0's work.
            ops.append((dest, "smov", None, [("imm", 0)]))
            continue
        if name.startswith("dma.") and "hbm" in name:
            # HBM traffic: ("dma", predicate, bytes moved or None where the size is a register). A copy
            # within HBM reads and writes.
            guard = re.search(r"\((!?)%p\w*_(p\d+)\)", rest)
            size = re.search(r"/\*size_in_granules=\*/\s*(\d+)\b", raw)
            ops.append(("dma", (guard.group(1) == "!", guard.group(2)) if guard else None,
                        int(size.group(1)) * HBM_GRANULE_BYTES * (2 if name.startswith("dma.hbm_to_hbm") else 1)
                        if size else None))
            continue
        if name.startswith(("v", "dma", "int_to_ptr")) or name in ("sphi", "shalt.err", "sfence"):
            # Vector and other DMA ops; phis are copies into the same physical register after allocation, and
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
            if target:
                ops.append(("sbr", predicate, (int(target.group(1)), int(target.group(2)))))
            else:  # newer libtpu (0.0.52) names the region alone: "target = $region28"
                ops.append(("sbr", predicate, (None, int(re.search(r"target = \$region(\d+)", rest).group(1)))))
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


@dataclasses.dataclass(frozen=True)
class _Decoded:
    """One final_bundles dump, decoded for :func:`executed_schedule`.

    Per bundle, in dump order: ``texts`` (its line), ``loop_heads`` (whether it starts a loop
    body, an "LB" bundle), ``ops`` (its op names) and ``scalar_ops`` (what the interpreter runs,
    :func:`_scalar_ops`); ``next_scalar[i]`` is the first bundle at or after ``i`` with a scalar op
    (the bundle count where none is); ``regions`` maps a region number to the bundles marking it.
    """

    texts: tuple
    loop_heads: tuple
    ops: tuple
    scalar_ops: tuple
    next_scalar: tuple
    regions: dict


def _decode(dump):
    bundles = _bundles(dump)
    texts = tuple(text for _, _, _, text in bundles)
    scalar_ops = tuple(_scalar_ops(text) for text in texts)
    next_scalar = [len(texts)] * (len(texts) + 1)
    for i in range(len(texts) - 1, -1, -1):
        next_scalar[i] = i if scalar_ops[i] else next_scalar[i + 1]
    # A branch names the region it goes to: a branch back, the loop whose head starts that region (an
    # "LB" bundle, "Start region N"); a branch forward, around a skipped region, the empty region that
    # marks where it lands ("Start/End empty region N", a "PF" bundle).
    regions = {}
    for i, text in enumerate(texts):
        for region in re.findall(r"Start(?:/End empty)? region (\d+)\b", text):
            regions.setdefault(int(region), []).append(i)
    return _Decoded(texts=texts, loop_heads=tuple(head for _, head, _, _ in bundles),
                    ops=tuple(ops for _, _, ops, _ in bundles), scalar_ops=scalar_ops,
                    next_scalar=tuple(next_scalar), regions=regions)


def _branch_target(decoded, pc, bundleno, region, name):
    """The bundle index the branch at bundle ``pc`` goes to: ``region`` is the region it names, and
    ``bundleno`` its target's bundle number (``None`` where the dump names the region alone).

    The region's mark says the direction: a branch back names the loop whose head starts that
    region (an "LB" bundle at or before ``pc``), a branch forward the empty region it lands on
    after ``pc``. A "bundleno" is not the dump's bundle index: it counts instruction words, and
    long bundles take more than one, so it can exceed the index of a branch that goes back (the
    closing branch of a loop after a run of long bundles); it decides only where a region is
    marked on both sides."""
    here = int(decoded.texts[pc].split()[0], 0)
    candidates = decoded.regions.get(region, [])
    back = [i for i in candidates if i <= pc and decoded.loop_heads[i]]
    forward = [i for i in candidates if i > pc]
    if forward and back:
        goes_back = bundleno is not None and bundleno <= here
        return back[-1] if goes_back else forward[0]
    if back:
        return back[-1]
    if forward:
        return forward[0]
    if (bundleno is None or bundleno > here) and "exit bundle" in decoded.texts[-1]:
        return len(decoded.texts) - 1  # a branch to the program's end (v5p: the second TensorCore skipping a fusion)
    raise ValueError(f"{name}: no target for the branch at bundle {pc} (bundle number {bundleno}, region {region})")


def _address(operand, registers):
    """An SMEM address's key: its allocation text, with a register's value where it has one."""
    text = operand[1]
    register = re.fullmatch(r"%[sp]\w*_([sp]\d+)(.*)", text)
    if register:
        value = registers.get(register.group(1))
        return None if value is None else f"{value}{register.group(2)}"
    return text


class _ScalarUnit:
    """The sequencer's state while :func:`executed_schedule` runs a dump called ``name``: its
    registers, its SMEM words, and the bytes its DMAs moved to and from HBM (``None`` once a
    DMA's size is not a constant). ``None`` stands for a value it cannot know."""

    def __init__(self, name):
        self.name = name
        self.registers, self.memory = {}, {}
        self.dma_bytes = 0

    def value(self, operand):
        kind, content = operand
        if kind == "imm":
            return content
        if kind == "reg":
            return self.registers.get(content)
        return None

    def issue(self, decoded, pc):
        """Runs bundle ``pc``'s scalar ops (each reads the registers as the bundle found them) and
        returns its branch as (its target if taken, else ``None``), or ``None`` without one.

        Raises:
            ValueError: a branch on an unknown predicate, or one whose target the dump does not mark.
        """
        writes, branch = [], None
        for op in decoded.scalar_ops[pc]:
            if op[0] == "dma":
                self._count_dma(*op[1:])
            elif op[0] == "sbr":
                taken = self._branch_taken(op[1], pc)
                branch = (_branch_target(decoded, pc, *op[2], self.name) if taken else None,)
            else:
                writes.extend(self._scalar(*op))
        for dest, result in writes:
            if isinstance(dest, tuple):
                self.memory[dest[1]] = result
            else:
                self.registers[dest] = result
        return branch

    def _count_dma(self, predicate, size):
        flag = None if predicate is None else self.registers.get(predicate[1])
        if flag is None or bool(flag) != predicate[0]:
            self.dma_bytes = None if self.dma_bytes is None or size is None else self.dma_bytes + size

    def _branch_taken(self, predicate, pc):
        if predicate is None:
            return True
        flag = self.registers.get(predicate[1])
        if flag is None:
            raise ValueError(f"{self.name}: the branch at bundle {pc} depends on an unknown predicate ({predicate[1]})")
        return (not flag) if predicate[0] else bool(flag)

    def _scalar(self, dest, opcode, predicate, operands):
        """The writes ([(register or ("mem", address), value)]) of one scalar op."""
        if predicate is not None:
            flag = self.registers.get(predicate[1])
            if flag is None:
                return [] if dest is None else [(dest, None)]
            if flag == predicate[0]:  # (!p) with p true, or (p) with p false: the op does not issue
                return []
        if opcode == "sst":
            address = _address(operands[0], self.registers)
            return [] if address is None else [(("mem", address), self.value(operands[1]))]
        if opcode == "sld":
            address = _address(operands[0], self.registers) if operands[0][0] == "mem" else None
            result = self.memory.get(address)
        elif opcode in ("smov", "smov.u32", "pmov"):  # libtpu 0.0.21 writes smov, 0.0.52 smov.u32
            result = self.value(operands[0]) if operands else None
        elif opcode == "pneg":
            flag = self.value(operands[0])
            result = None if flag is None else not flag
        elif opcode == "scalar_select":
            flag, on_true, on_false = (self.value(o) for o in operands)
            result = None if flag is None else (on_true if flag else on_false)
        elif opcode in _BINARY and len(operands) == 2:
            a, b = self.value(operands[0]), self.value(operands[1])
            result = None if a is None or b is None else _BINARY[opcode](a, b)
        else:
            result = None  # addresses, pops from vector units, parameters: not needed for control flow
        return [(dest, result)]


_MAX_INTERPRETED_BUNDLES = 10**8


def _issued_runs(decoded, unit, delay_slots, name):
    """Yields ``(first, stop)``: bundles ``first`` to ``stop - 1`` issue, in the order they issue.
    A branch takes effect after ``delay_slots`` more bundles."""
    n = len(decoded.texts)
    pc, pending, steps = 0, None, 0  # pending: [delay slots left, target or None] of a branch issued
    while pc < n:
        steps += 1
        if steps > _MAX_INTERPRETED_BUNDLES:
            raise ValueError(f"{name}: still running after 10^8 interpreted bundles")
        if pending is None and not decoded.scalar_ops[pc]:
            # Straight through the bundles that hold no scalar op.
            stop = decoded.next_scalar[pc]
            yield pc, stop
            pc = stop
            if pc >= n:
                break
        yield pc, pc + 1
        branch = unit.issue(decoded, pc)
        if pending is not None:
            pending[0] -= 1
        if branch is not None:
            if pending is not None:
                raise ValueError(f"{name}: a branch in another branch's delay slots at bundle {pc}")
            pending = [delay_slots, *branch]
        pc += 1
        if pending is not None and pending[0] == 0:
            target, pending = pending[1], None
            if target is not None:
                pc = target
        elif pending is not None and pending[0] > 0 and pc >= n:
            break


def executed_schedule(dump: str, generation: str, name: str = "the dump") -> dict:
    """Bundles issued by one run of a compiled kernel (or XLA fusion) on one TensorCore, following
    its control flow.

    The scalar unit's ops are interpreted (integer arithmetic, compares, predicates, SMEM spills),
    branches taken as their predicates say after ``generation``'s branch delay slots; the
    TensorCore's index reads as 0 (a megacore's first core). Values the sequencer reads from
    outside (operand addresses, key words in SMEM, vector results popped to scalars) are unknown.
    DMAs to or from HBM count their bytes when their predicate holds (or is unknown).

    Args:
        dump: the final_bundles dump (its text).
        generation: a key of :data:`HARDWARE` (v4, v5e, v5p, v6e).
        name: what error messages call the dump.

    Returns:
        dict: ``"bundles"`` (total issued), ``"counts"`` (issues per bundle, in dump order),
        ``"ops"`` (op names per bundle), ``"hbm_dma_bytes"`` (bytes the DMAs moved to and from
        HBM; ``None`` if a size is not a constant).

    Raises:
        ValueError: an unknown ``generation``; a branch on an unknown value, or one whose target
            the dump does not mark.
        NotImplementedError: a generation whose dumps this does not read (TPU7x).
    """
    delay_slots = _hardware(generation).branch_delay_slots
    if generation == "tpu7x":
        raise NotImplementedError("tpu7x: executed_schedule reads v4 to v6e only (TPU7x's clock is not published, "
                                  "and how its dumps' control flow runs has not been checked against one)")
    decoded = _decode(dump)
    unit = _ScalarUnit(name)
    difference = [0] * (len(decoded.texts) + 1)  # counts, as differences: a run adds 1 from its first bundle on
    for first, stop in _issued_runs(decoded, unit, delay_slots, name):
        difference[first] += 1
        difference[stop] -= 1
    counts = list(itertools.accumulate(difference[:-1]))
    return {"bundles": sum(counts), "counts": counts, "ops": list(decoded.ops), "hbm_dma_bytes": unit.dma_bytes}


def executed_or_static_schedule(dump: str, generation: str, name: str = "the dump") -> tuple[dict, bool]:
    """``(run, followed)``: :func:`executed_schedule`'s run and ``True``, or, where it cannot follow
    the control flow (a branch on a value from outside: data, a dynamic index), ``False`` and the
    static schedule instead: every loop at its trip count, every conditional region taken
    (:func:`static_schedule`'s bundles; each bundle once where it cannot read the loops either).
    That run holds ``"bundles"`` only, and ``"hbm_dma_bytes"`` ``None``.

    Raises:
        ValueError, NotImplementedError: an unknown or unread ``generation``, as :func:`executed_schedule`.
    """
    _hardware(generation)
    try:
        return executed_schedule(dump, generation, name=name), True
    except ValueError:
        try:
            bundles = static_schedule(dump)["bundles"]
        except (StopIteration, ValueError):  # a loop whose closing branch or body start the dump does not mark
            bundles = bundle_count(dump)
        return {"bundles": bundles, "hbm_dma_bytes": None}, False


# --- HBM bytes, from the optimised HLO -----------------------------------------------------------------------------

# An array in an HLO type: element type, dimensions, layout (a memory space S(n) among its tiles).
HLO_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]\{([^}]*)\}")
_BITS = {"pred": 8}
_MOVES = ("fusion", "custom-call", "rng-bit-generator", "copy-start", "slice-start", "copy", "add", "multiply",
          "select", "convert", "concatenate", "dynamic-update-slice")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.-]+) = (.*?) ([\w-]+)\((.*?)\)(?:, |$)")
# Control flow whose body would run more or less often than once per step.
_CONTROL_FLOW = ("while", "call", "conditional")


def array_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array of element type ``dtype`` and dimensions ``dims`` (as :data:`HLO_ARRAY`
    reads them: ``"f32"``, ``"32,197,768"``)."""
    return math.prod(int(d) for d in dims.split(",") if d) * (_BITS.get(dtype) or int(re.sub(r"\D", "", dtype))) // 8


def _hbm_arrays(type_text):
    """Bytes of each array in an HLO type that lives in HBM (no ``S(n)`` memory space: S(1) is VMEM)."""
    return [0 if "S(" in layout else array_bytes(dtype, dims) for dtype, dims, layout in HLO_ARRAY.findall(type_text)]


def entry_computation(hlo: str) -> str:
    """The text of the ``ENTRY`` computation of an HLO module's text ``hlo``."""
    return hlo[hlo.find("\nENTRY"):]


def hbm_bytes_by_instruction(hlo: str) -> dict:
    """HBM bytes read and written by each instruction of an optimised HLO module's entry computation.

    Instructions that move data (fusions, custom calls (Mosaic kernels among them), the RNG,
    copies and slices) read their HBM operands once and write their HBM results once. Buffers
    the compiler placed in VMEM (layout ``S(1)``: v5e and v6e put whole 16 MiB masks and copies
    there) cost no HBM traffic. Async ``copy-start`` / ``slice-start`` read their source (the
    slice only) and write their destination.

    Args:
        hlo: the optimised HLO module's text (libtpu's ``*-TLP-hlo.txt`` dump).

    Returns:
        dict: ``{instruction name: bytes}`` for the instructions that move data, in program order.
    """
    types, moved = {}, {}
    for line in entry_computation(hlo).splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, type_text, op, operands = match.groups()
        types[name] = type_text
        if op not in _MOVES:
            continue
        results = _hbm_arrays(type_text)
        if op in ("copy-start", "slice-start"):
            # copy-start gives (destination, source, context) (its copy-done returns the
            # first), slice-start ((source), destination, context). The bytes moved are the
            # destination's, read from the source and written to the destination, each costing
            # HBM traffic where it lives in HBM (a prefetch into VMEM, S(1), reads HBM once).
            destination_index = 0 if op == "copy-start" else 1
            dtype, dims, _ = HLO_ARRAY.findall(type_text)[destination_index]
            size = array_bytes(dtype, dims)
            source = _hbm_arrays(types.get(operands.strip("%"), ""))
            moved[name] = (size if source and source[0] else 0) + (size if results[destination_index] else 0)
            continue
        moved[name] = sum(results) + sum(sum(_hbm_arrays(types.get(operand, "")))
                                         for operand in re.findall(r"%([\w.-]+)", operands))
    return moved


def hbm_bytes(hlo: str) -> int:
    """HBM bytes read and written by an optimised HLO module's entry computation: the sum of
    :func:`hbm_bytes_by_instruction`."""
    return sum(hbm_bytes_by_instruction(hlo).values())


# --- the dumps of one compile ----------------------------------------------------------------------------------------

def _label(file_name):
    """What libtpu named the code a dump file holds: "TLP", a fusion's or kernel's HLO name."""
    return re.sub(r"^\d+-|-\d+-final_bundles\.txt$", "", file_name)


def final_bundles(dumps: Mapping[str, str]) -> dict:
    """``{label: dump}`` of the final_bundles dumps among ``dumps`` (``{file name: text}``), each
    labelled as libtpu names the code: ``"TLP"`` (the top-level program), ``"<late-initialization>"``
    and ``"<late-finalization>"`` (its parts, newer libtpu) or the HLO instruction's name."""
    return {_label(name): text for name, text in sorted(dumps.items())
            if name.endswith("final_bundles.txt") and "schedule-analysis" not in name}


def optimized_hlo(dumps: Mapping[str, str]) -> str:
    """The optimised HLO module's text among ``dumps`` (libtpu's ``*-TLP-hlo.txt``).

    Raises:
        ValueError: ``dumps`` hold no program's HLO, or more than one.
    """
    modules = [text for name, text in dumps.items() if name.endswith("-TLP-hlo.txt")]
    if len(modules) != 1:
        raise ValueError(f"dumps must hold the dump of exactly one compiled program, got {len(modules)} optimised "
                         "HLO modules (*-TLP-hlo.txt)")
    return modules[0]


def kernel_dumps(dumps: Mapping[str, str]) -> dict:
    """``{label: dump}`` of the Mosaic kernels' (Pallas calls', custom calls') final bundles among ``dumps``."""
    return {label: text for label, text in final_bundles(dumps).items()
            if not _is_program(label) and "= custom-call(" in text}


def _is_program(label):
    return label == "TLP" or label.startswith("<")


def _instruction(label, dump):
    """The HLO instruction a fusion's or kernel's dump compiles (its entry bundle names it)."""
    entry = re.search(r"entry bundle: %([\w.-]+) = ", dump)
    return entry.group(1) if entry else label


# --- the whole program ---------------------------------------------------------------------------------------------

KINDS = ("fusion", "kernel", "copy")


@dataclasses.dataclass(frozen=True)
class OpEstimate:
    """One fusion, kernel or copy of a compiled program, as :func:`estimate` costs it.

    ``kind`` is ``"kernel"`` (a Mosaic custom call), ``"fusion"`` (code XLA generated: a fusion
    or a lone instruction such as the RNG) or ``"copy"`` (an async copy or slice the top-level
    program issues as a DMA: no code of its own). ``bundles`` issued by one run (on one
    TensorCore) and ``schedule_seconds`` (bundles / clock); ``hbm_bytes`` read and written and
    ``hbm_seconds`` (bytes / HBM bandwidth); ``seconds`` is the longer of the two. ``followed``
    is False where its control flow branches on data (:func:`executed_schedule` cannot follow
    it): its bundles are then :func:`static_schedule`'s, every conditional region counted.
    """

    name: str
    kind: str
    bundles: int
    schedule_seconds: float
    hbm_bytes: int
    hbm_seconds: float
    followed: bool = True

    @property
    def seconds(self) -> float:
        return max(self.schedule_seconds, self.hbm_seconds)


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """A compiled program's time on one chip of ``generation``, from the compiler's schedule.

    ``seconds`` is the top-level program's own bundles at the clock (``program_bundles``,
    ``program_seconds``: the sequencer launching each op) plus, for every op in ``ops``
    (:class:`OpEstimate`), the longer of its schedule and its HBM time. An estimate, not a
    measurement: it leaves out DMA waits inside kernels and fusions beyond their HBM time, any
    overlap between ops (each is counted whole, one after another), stalls the schedule does
    not show, and a megacore's second TensorCore (each op's bundles are one core's).
    """

    generation: str
    program_bundles: int
    program_seconds: float
    ops: tuple

    @property
    def seconds(self) -> float:
        return self.program_seconds + sum(op.seconds for op in self.ops)

    @property
    def bundles(self) -> int:
        """Bundles issued: the top-level program's and every op's."""
        return self.program_bundles + sum(op.bundles for op in self.ops)

    @property
    def hbm_bytes(self) -> int:
        """HBM bytes every op reads and writes."""
        return sum(op.hbm_bytes for op in self.ops)

    def table(self, top: int = 20) -> str:
        """The estimate as a text table: the ``top`` ops that take longest, then the rest and the
        top-level program in one line each, and the total.

        Args:
            top: how many ops to list one per line (a positive int).

        Raises:
            ValueError: ``top`` is not a positive int.
        """
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ValueError(f"top must be a positive int, got {top!r}")
        ops = sorted(self.ops, key=lambda op: op.seconds, reverse=True)
        rows = [(op.name, op.kind, f"{op.bundles}", f"{op.schedule_seconds * 1e6:.2f}", f"{op.hbm_bytes}",
                 f"{op.hbm_seconds * 1e6:.2f}", f"{op.seconds * 1e6:.2f}") for op in ops[:top]]
        rest = ops[top:]
        if rest:
            rows.append((f"({len(rest)} more)", "", f"{sum(op.bundles for op in rest)}",
                         f"{sum(op.schedule_seconds for op in rest) * 1e6:.2f}", f"{sum(op.hbm_bytes for op in rest)}",
                         f"{sum(op.hbm_seconds for op in rest) * 1e6:.2f}",
                         f"{sum(op.seconds for op in rest) * 1e6:.2f}"))
        rows.append(("(top-level program)", "", f"{self.program_bundles}", f"{self.program_seconds * 1e6:.2f}", "", "",
                     f"{self.program_seconds * 1e6:.2f}"))
        rows.append(("total", "", f"{self.bundles}", "", f"{self.hbm_bytes}", "", f"{self.seconds * 1e6:.2f}"))
        header = ("op", "kind", "bundles", "schedule us", "HBM bytes", "HBM us", "us")
        widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
        lines = [f"{self.generation}: {self.seconds * 1e6:.2f} us estimated"]
        for row in [header] + rows:
            lines.append("  ".join(cell.ljust(width) if i < 2 else cell.rjust(width)
                                   for i, (cell, width) in enumerate(zip(row, widths))))
        return "\n".join(lines)


def _op_hbm(kind, run, hbm):
    """An op's HBM bytes: its operands' and results', or a kernel's own DMAs where they move more."""
    if kind == "kernel" and run["hbm_dma_bytes"] is not None:
        return max(hbm, run["hbm_dma_bytes"])
    return hbm


def _code_signature(hlo, match, types):
    """What the code of an entry instruction (``match``: its :data:`_INSTRUCTION` match) depends on:
    its op, its result's and operands' types (``types``: the entry's ``{name: type}``) and its
    attributes, or its fused computation, without instruction names and metadata."""
    line = match.string
    operands = [types.get(name, "") for name in re.findall(r"%([\w.-]+)", match.group(4))]
    called = re.search(r"calls=%([\w.-]+)", line)
    body = ""
    if called:
        start = re.search(r"^%" + re.escape(called.group(1)) + r" .*\{$", hlo, re.M)
        body = hlo[start.end():hlo.index("\n}", start.end())] if start else called.group(1)
    text = re.sub(r"%[\w.-]+|, metadata=\{[^}]*\}", "", line[line.index("=") + 1:] + body)
    return text, tuple(operands)


def estimate(dumps: Mapping[str, str], generation: str) -> StepEstimate:
    """Estimates one compiled program's time on one chip of ``generation`` from libtpu's dumps.

    Every XLA fusion and Mosaic kernel is run through its control flow
    (:func:`executed_schedule`: bundles issued, at the clock) and costed its HBM time: a fusion's
    HBM operands and results (:func:`hbm_bytes_by_instruction`), a kernel's the larger of that
    and the bytes its own DMAs move to and from HBM (DMAs issued x their sizes, read off its
    bundles: a flash kernel re-reads K and V once per query block). Each op takes the longer of
    the two (an op whose branches depend on data counts :func:`static_schedule`'s bundles instead:
    ``OpEstimate.followed``); async copies the top-level program issues take their HBM time. The sum, plus the
    top-level program's own bundles (each once: it launches every op once), is the estimate
    (:class:`StepEstimate`, which says what it leaves out).

    Args:
        dumps: ``{file name: text}`` of one compile's dumps: its final_bundles dumps and its
            optimised HLO, as ``tpu_compile.compiler_dumps()`` collects them.
        generation: the generation it was compiled for (v4, v5e, v5p, v6e).

    Returns:
        :class:`StepEstimate`.

    Raises:
        ValueError: an unknown ``generation``; ``dumps`` hold no program, or more than one;
            a fusion's or kernel's branch :func:`executed_schedule` cannot follow.
        NotImplementedError: the entry computation has a ``while``, ``call`` or ``conditional``
            at top level (its body would be counted once, not as often as it runs); a generation
            whose constants or dumps are not established (TPU7x).
    """
    hardware = _hardware(generation, "clock")
    hlo = optimized_hlo(dumps)
    instructions = [match for match in map(_INSTRUCTION.match, entry_computation(hlo).splitlines()) if match]
    by_name = {match.group(1): match for match in instructions}
    types = {name: match.group(2) for name, match in by_name.items()}
    looping = sorted({match.group(1) for match in instructions if match.group(3) in _CONTROL_FLOW})
    if looping:
        raise NotImplementedError(f"the program's entry computation has control flow at top level "
                                  f"({', '.join(looping)}): "
                                  "estimate counts every op once, not as often as a loop or branch runs it")
    kernels = {match.group(1) for match in instructions
               if match.group(3) == "custom-call" and 'custom_call_target="tpu_custom_call"' in match.string}
    moved = hbm_bytes_by_instruction(hlo)
    program_bundles, ops, runs = 0, [], {}

    def op_estimate(name, kind, bundles, hbm, followed=True):
        return OpEstimate(name=name, kind=kind, bundles=bundles, schedule_seconds=bundles / hardware.clock,
                          hbm_bytes=hbm, hbm_seconds=hbm / hardware.hbm_bandwidth, followed=followed)

    for label, dump in final_bundles(dumps).items():
        if _is_program(label):
            program_bundles += bundle_count(dump)
            continue
        instruction = _instruction(label, dump)
        kind = "kernel" if instruction in kernels else "fusion"
        run, followed = executed_or_static_schedule(dump, generation, name=label)
        runs[_code_signature(hlo, by_name[instruction], types)] = (kind, run, followed)
        ops.append(op_estimate(instruction, kind, run["bundles"], _op_hbm(kind, run, moved.pop(instruction, 0)),
                               followed))
    # libtpu generates code once for instructions that compute the same thing (the same kernel
    # on same-shaped operands, fusions of the same computation): they run the dumped one's.
    for match in instructions:
        if match.group(1) not in moved:
            continue
        shared = runs.get(_code_signature(hlo, match, types))
        if shared:
            kind, run, followed = shared
            ops.append(op_estimate(match.group(1), kind, run["bundles"], _op_hbm(kind, run, moved.pop(match.group(1))),
                                   followed))
    ops += [op_estimate(name, "copy", 0, hbm) for name, hbm in moved.items() if hbm]
    return StepEstimate(generation=generation, program_bundles=program_bundles,
                        program_seconds=program_bundles / hardware.clock, ops=tuple(ops))
