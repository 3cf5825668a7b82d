"""What a training step's HBM holds at its peak, as libtpu's buffer assignment plans it, and what XLA copies.

    .venv/xla/bin/python bench/tpu_peak.py --model vit --attention eager \\
        --variants "torch_pallas hardware" torch --generation v6e

Compiles one step of ``bench_tpu_step`` (same models, batch and variants) for one generation with
XLA's dumps (``tpu_compile.compile_graph(..., dump_to=...)``), reads the compile's
``after_optimizations-buffer-assignment.txt`` and reports, for the block of temporaries in HBM
(the largest ``preallocated-temp`` allocation without a memory color), its size, the most bytes
live in it at once and the largest buffers live then, each with its shape and layout (a layout's
tiles show its padding: ``f32[...,197,64]{...:T(8,128)}`` takes 128 lanes per row); and from the
optimised HLO (``*after_optimizations.txt``), the copies XLA added (``copy`` ops: layout changes,
and some moves into on-chip memory, ``S(1)`` in the layout; the asynchronous ``copy-start``
prefetches are not counted): how many, their bytes, the largest by the value they copy, named by
its shape and layout and the op it comes from; and from its schedule (the ENTRY computation's order),
where the weight-gradient products run against the torch_pallas kernels (:func:`product_schedule`).
``--layers`` builds the models deeper than the step table's 2. Written to
``results/tpu_peak.{json,md}``, rows of earlier runs of other steps or at other commits kept.

Read the block's live bytes, not the dump's "Stack trace breakdown for peak usage": that counts
parameters and the sources of asynchronous copies too, so two steps' figures there do not compare
with their blocks of temporaries.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, commit, markdown_table, merged_rows, write  # noqa: E402

MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Buffer:
    name: str
    bytes: int
    offset: int
    shape: str
    live: tuple[int, int]  # first and last position in the program's instruction sequence


@dataclasses.dataclass(frozen=True)
class HeapPeak:
    heap_bytes: int  # the block of temporaries
    live_bytes: int  # the most bytes live in it at once
    position: int  # where in the instruction sequence
    live: tuple[Buffer, ...]  # the buffers live there, largest first


def heap_peak(buffer_assignment: str) -> HeapPeak:
    """The peak of the block of temporaries in an XLA ``*after_optimizations-buffer-assignment.txt``."""
    allocations, current = {}, None
    for line in buffer_assignment.splitlines():
        found = re.match(r"allocation \d+: size (\d+)(.*)", line)
        if found:
            current = (int(found[1]), found[2], len(allocations))
            allocations[current] = []
            continue
        if line.startswith("Total bytes used"):
            current = None
        found = re.match(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)", line)
        if found and current is not None:
            # The live ranges name a value without an index as "name{}".
            name = found[1] if "{" in found[1] else found[1] + "{}"
            allocations[current].append((name, int(found[2]), int(found[3]), found[4]))
    ranges = dict((name, (int(first), int(last))) for name, first, last in
                  re.findall(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", buffer_assignment, re.MULTILINE))
    heap = max((a for a in allocations if "preallocated-temp" in a[1] and "color" not in a[1]), key=lambda a: a[0])
    buffers = [Buffer(name, size, offset, shape, ranges[name]) for name, size, offset, shape in allocations[heap]
               if name in ranges]
    length = max(buffer.live[1] for buffer in buffers) + 1
    live_bytes = [0] * length
    for buffer in buffers:
        for position in range(buffer.live[0], buffer.live[1] + 1):
            live_bytes[position] += buffer.bytes
    position = max(range(length), key=live_bytes.__getitem__)
    live = sorted((b for b in buffers if b.live[0] <= position <= b.live[1]), key=lambda b: (-b.bytes, b.name))
    return HeapPeak(heap[0], live_bytes[position], position, tuple(live))


_COPY = re.compile(r"= (\S+) copy\(")  # a copy instruction and its result's type


def layout_copies(hlo: str, top: int) -> dict:
    """The ``copy`` ops in an optimised HLO module's text: ``count``, ``bytes`` (each copy's result:
    what it writes) and the ``largest`` groups of them by (source op, shape and layout), as
    ``[bytes, count, shape, source]``."""
    from torch_pallas import tpu_schedule

    groups = {}
    for line in hlo.splitlines():
        found = _COPY.search(line)
        if not found:
            continue
        [(dtype, dims, layout)] = tpu_schedule.HLO_ARRAY.findall(found[1])
        source = re.search(r'op_name="([^"]*)"', line)
        # The op's kind, not its instance: "dot.1067" and "dot.912" copy alike.
        key = (f"{dtype}[{dims}]{{{layout}}}", re.sub(r"\.\d+$", "", source[1].rsplit("/", 1)[-1]) if source else "")
        total, count = groups.get(key, (0, 0))
        groups[key] = (total + tpu_schedule.array_bytes(dtype, dims), count + 1)
    largest = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
    return {"count": sum(count for _, count in groups.values()), "bytes": sum(total for total, _ in groups.values()),
            "largest": [[total, count, shape, source] for (shape, source), (total, count) in largest]}


_ENTRY_OP = re.compile(r"^  (?:ROOT )?%\S+ = (\(.*?\)|\S+) (\S+?)\((.*)$", re.MULTILINE)  # shape, op, the rest


def product_schedule(hlo: str) -> dict:
    """Where a step's weight-gradient products run, from an optimised, scheduled HLO module's text:
    ``products``, the output fusions (``kind=kOutput``: a dot or convolution with what XLA fused
    into it) whose result has a parameter's shape, and the ``first_product`` and ``last_kernel``
    (the last Pallas kernel, ``tpu_custom_call``; None without one) as fractions of the ENTRY
    computation's instructions, in the order they run. Products that run late keep what they read (the
    gradients and activations of every layer) alive across the backward."""
    ops = [(shape.split("{")[0], op, rest) for shape, op, rest in _ENTRY_OP.findall(hlo[hlo.index("\nENTRY "):])]
    parameter_shapes = {shape for shape, op, _ in ops if op == "parameter"}
    products = [i for i, (shape, op, rest) in enumerate(ops)
                if op == "fusion" and shape in parameter_shapes and "kind=kOutput" in rest]
    kernels = [i for i, (_, op, rest) in enumerate(ops)
               if op == "custom-call" and 'custom_call_target="tpu_custom_call"' in rest]
    return {"instructions": len(ops), "products": len(products),
            "first_product": products[0] / len(ops) if products else None,
            "last_kernel": kernels[-1] / len(ops) if kernels else None}


def compile_with_dumps(outputs, generation: str) -> tuple:
    """``tpu_compile.compile_graph(outputs, generation)`` with XLA's dumps: the compilation, its
    buffer assignment's text and its optimised HLO's text."""
    from torch_pallas import tpu_compile

    with tempfile.TemporaryDirectory(prefix="tpu_peak_") as directory:
        compiled = tpu_compile.compile_graph(outputs, generation, dump_to=directory)
        [buffers] = Path(directory).glob("*after_optimizations-buffer-assignment.txt")
        [hlo] = Path(directory).glob("*after_optimizations.txt")
        return compiled, buffers.read_text(), hlo.read_text()


def measure(model, batch, variant: str, generation: str, top: int) -> dict:
    import bench_tpu_step

    outputs = bench_tpu_step.step_outputs(model, batch, variant)
    compiled, buffer_assignment, hlo = compile_with_dumps(outputs, generation)
    peak = heap_peak(buffer_assignment)
    copies = layout_copies(hlo, top)
    schedule = product_schedule(hlo)
    del outputs
    model.zero_grad(set_to_none=True)
    return {"variant": variant, "generation": generation, "commit": commit(), "peak_bytes": compiled.peak_bytes,
            "heap_bytes": peak.heap_bytes, "live_bytes": peak.live_bytes,
            "largest_live": [[b.bytes, b.shape, b.name] for b in peak.live[:top]], "copies": copies,
            "schedule": schedule}


def render(records: list) -> str:
    notes = ("One training step of `bench_tpu_step` (its models, batch and variants; `layers`: the models' depth, "
             "2 in tpu_step.md) compiled for one "
             "chip by libtpu's compile-only client with XLA's dumps (`compile_graph(..., dump_to=...)`); from its "
             "buffer assignment: the block of temporaries in HBM (MiB), the most bytes live in it at once, and "
             "the largest buffers live then with their layouts (`T(8,128)`: 128 lanes per row; an f32 "
             "`[...,197,64]` array takes twice its bytes); from its optimised HLO, the `copy` ops XLA added (layout "
             "changes, and some moves into on-chip memory, `S(1)`; not the asynchronous prefetches): count and MiB "
             "written, and per step the largest by the value copied: its shape and layout, and the op it comes "
             "from; from its schedule, the weight-gradient products (output fusions with a parameter's shape): how "
             "many, and where the first runs and where the last torch_pallas kernel runs, as a share of the "
             "program's instructions in order. Compiler plans, not TPU measurements. Each model and "
             "attention is a run of its own (`--model`, `--attention`), some side by side: compile-only figures "
             "do not depend on the machine's load.\n\n")
    table = markdown_table(
        ["model", "layers", "attention", "variant", "generation", "commit", "peak HBM (MiB)", "temporaries (MiB)",
         "live at their peak (MiB)", "copies: count: MiB", "products: count, first at", "last kernel at"],
        [[r["model"], str(r["layers"]), r["attention"], r["variant"], r["generation"], r.get("commit", "—"),
          f"{r['peak_bytes'] / MIB:.1f}", f"{r['heap_bytes'] / MIB:.1f}", f"{r['live_bytes'] / MIB:.1f}",
          f"{r['copies']['count']}: {r['copies']['bytes'] / MIB:.0f}" if "copies" in r else "—",
          *schedule_cells(r.get("schedule"))]
         for r in records])
    for r in records:
        table += (f"\n{r['model']} {r['attention']}, {r['variant']}, {r['generation']} ({r.get('commit', '—')}): "
                  "largest buffers live at the peak\n\n" + markdown_table(["MiB", "shape and layout", "buffer"],
                                                  [[f"{size / MIB:.2f}", f"`{shape}`", name]
                                                   for size, shape, name in r["largest_live"]]))
        if "copies" in r:
            table += (f"\n{r['model']} {r['attention']}, {r['variant']}, {r['generation']} ({r['commit']}): largest "
                      "copies\n\n" + markdown_table(["MiB", "copies", "shape and layout", "copied value's op"],
                                                          [[f"{size / MIB:.1f}", count, f"`{shape}`", source]
                                                           for size, count, shape, source in r["copies"]["largest"]]))
    return notes + table


def schedule_cells(schedule) -> list:
    if schedule is None:  # rows measured before the schedule was read
        return ["—", "—"]
    share = lambda fraction: "—" if fraction is None else f"{fraction:.0%}"  # noqa: E731
    return [f"{schedule['products']}, {share(schedule['first_product'])}", share(schedule["last_kernel"])]


def _key(record):
    # A step measured at another commit is another row: the kernels may have changed.
    return (record["model"], record["layers"], record["attention"], record["variant"], record["generation"],
            record.get("commit"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--attention", required=True)
    parser.add_argument("--variants", nargs="+", required=True)
    parser.add_argument("--generation", required=True)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--layers", type=int, help="the models' depth (default: bench_tpu_step.LAYERS)")
    options = parser.parse_args()
    import bench_tpu_step

    layers = options.layers or bench_tpu_step.LAYERS
    model, batch = bench_tpu_step.build(options.model, options.attention, layers)
    if model is None:
        raise SystemExit(batch)
    records = [{"model": options.model, "layers": layers, "attention": options.attention,
                **measure(model, batch, variant, options.generation, options.top)} for variant in options.variants]
    path = RESULTS / "tpu_peak.json"
    records = merged_rows(json.loads(path.read_text())["results"] if path.exists() else [], records, _key)
    table = render(records)
    write("tpu_peak", {"mode": "compile only", "results": records}, table, None)
    print(table)


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_pallas  # noqa: F401  (torch_xla before JAX)

    main()
