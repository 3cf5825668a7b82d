"""The torch_xla stack's training steps compiled by the torchax stack's newer libtpu: whether a peak
HBM ratio of ``tpu_step.md`` comes from the compiler that torch_xla 2.9 pins (a diagnosis, not a
row of that table).

    .venv/xla/bin/python bench/tpu_step_newer_libtpu.py --models bert-128 --attentions sdpa eager \\
        --variants torch "torch_pallas tiled" --generations v6e [--layers 12]

Each step is built as ``bench_tpu_step`` builds it (same models, batch and variants) and compiled
for one chip of each generation twice: by this process's libtpu (0.0.21, torch_xla[tpu] 2.9's pin;
``tpu_compile.compile_graph``) and, from the same HLO proto, by ``.venv/torchax/bin/python``
(libtpu 0.0.52) through jax's compile-only client, as ``compile_graph`` does it. The Mosaic
kernels travel as they are, serialized by jax 0.7.1. Peak HBM (``peak_memory_in_bytes``; no time
estimate, which reads 0.0.21's dumps) and, from each compile's optimised HLO, where the
weight-gradient products run (``tpu_peak.product_schedule``). ``--layers`` builds the models
deeper than the step table's (12: the released models' depth). Written over the committed
``results/tpu_step_newer_libtpu.{json,md}``: a run replaces its own rows and keeps the others.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, merged_rows, write  # noqa: E402
from tpu_peak import compile_with_dumps, product_schedule, schedule_cells  # noqa: E402

TORCHAX_PYTHON = Path(__file__).resolve().parent.parent / ".venv" / "torchax" / "bin" / "python"
RESULTS_JSON = Path(__file__).resolve().parent / "results" / "tpu_step_newer_libtpu.json"
NEWER_LIBTPU = "0.0.52"  # constraints/torchax.txt's


def compile_proto(path: str, generation: str) -> None:
    """Prints the peak HBM bytes and the product schedule of the HLO proto at ``path`` compiled for
    ``generation`` by this process's libtpu, as JSON (run on the torchax stack)."""
    from importlib import metadata

    if "TPU_LIBRARY_PATH" in os.environ:  # jax would load that libtpu instead of its own
        sys.exit(f"TPU_LIBRARY_PATH is set ({os.environ['TPU_LIBRARY_PATH']})")
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    from torch_pallas import tpu_compile

    device = tpu_compile.tpu_device(generation)
    # jax 0.10.2's private converter (the torchax stack's pin) gives StableHLO bytecode; its
    # compile-only client takes a parsed module.
    with mlir.make_ir_context(), tempfile.TemporaryDirectory(prefix="newer_libtpu_") as dumps:
        module = ir.Module.parse(xla_client._xla.mlir.hlo_to_stablehlo(Path(path).read_bytes()))
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
        debug = options.executable_build_options.debug_options
        debug.xla_dump_to, debug.xla_dump_hlo_as_text = dumps, True
        executable = device.client.compile(module, executable_devices=xla_client.DeviceList((device,)),
                                           compile_options=options)
        [hlo] = Path(dumps).glob("*after_optimizations.txt")
        print(json.dumps({"peak_bytes": executable.get_compiled_memory_stats().peak_memory_in_bytes,
                          "schedule": product_schedule(hlo.read_text()), "libtpu": metadata.version("libtpu")}),
              flush=True)
    # The interpreter's finalization aborts after jax 0.10's MLIR context (a GIL error): skip it.
    os._exit(0)


def newer_compile(proto: bytes, generation: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".pb") as file:
        file.write(proto)
        file.flush()
        # torch_xla points TPU_LIBRARY_PATH (and its own copy) at its libtpu: the child must find its own.
        env = {k: v for k, v in os.environ.items() if k not in ("TPU_LIBRARY_PATH", "PTXLA_TPU_LIBRARY_PATH")}
        done = subprocess.run([str(TORCHAX_PYTHON), __file__, "--compile-proto", file.name, generation],
                              capture_output=True, text=True, env={**env, "JAX_PLATFORMS": "cpu"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"the torchax stack's compile failed ({done.returncode}): {done.stderr[-2000:]}")
    reply = json.loads(lines[-1])
    if reply["libtpu"] != NEWER_LIBTPU:
        raise RuntimeError(f"the torchax stack has libtpu {reply['libtpu']}, not {NEWER_LIBTPU}")
    return reply


def measure(models, attentions, variants, generations, layers) -> list:
    import torch_xla

    import bench_tpu_step

    records = []
    for model_name in models:
        for attention in attentions:
            model, batch = bench_tpu_step.build(model_name, attention, layers)
            if model is None:
                continue
            for variant in variants:
                outputs = bench_tpu_step.step_outputs(model, batch, variant)
                proto = torch_xla._XLAC._get_xla_tensors_hlo_proto(outputs)
                for generation in generations:
                    pinned, _, hlo = compile_with_dumps(outputs, generation)
                    newer = newer_compile(proto, generation)
                    record = {"model": model_name, "layers": layers, "attention": attention, "variant": variant,
                              "generation": generation, "pinned_peak_bytes": pinned.peak_bytes,
                              "newer_peak_bytes": newer["peak_bytes"], "pinned_schedule": product_schedule(hlo),
                              "newer_schedule": newer["schedule"]}
                    print(record, file=sys.stderr, flush=True)
                    records.append(record)
                # The CPU client cannot run these graphs: drop them before anything syncs.
                del outputs
                model.zero_grad(set_to_none=True)
    return records


def _key(record) -> tuple:
    return record["model"], record["layers"], record["attention"], record["variant"], record["generation"]


def render(records: list) -> str:
    from importlib import metadata

    pinned = metadata.version("libtpu")  # this process's: the torch_xla stack's
    torch_rows = {(r["model"], r["layers"], r["attention"], r["generation"]): r
                  for r in records if r["variant"] == "torch"}
    rows = []
    for r in records:
        torch_row = torch_rows.get((r["model"], r["layers"], r["attention"], r["generation"]))
        cells = [r["model"], str(r["layers"]), r["attention"], r["generation"], r["variant"]]
        for libtpu in ("pinned", "newer"):
            key = f"{libtpu}_peak_bytes"
            ratio = f" ({r[key] / torch_row[key]:.3f}x)" if torch_row and r is not torch_row else ""
            cells += [f"{r[key] / 2**20:.2f}{ratio}", *schedule_cells(r.get(f"{libtpu}_schedule"))]
        rows.append(cells)
    return ("Peak HBM (MiB) of one training step of `bench_tpu_step` (its models, batch and variants; "
            "`layers`: the model's depth, 2 in tpu_step.md, 12 in the released models), one "
            f"HLO compiled by libtpu {pinned} (the torch_xla stack's, as in tpu_step.md) and by libtpu "
            f"{NEWER_LIBTPU} (the torchax stack's), with the ratio to torch's dropout's step under the same "
            "compiler; from each compile's schedule, as in tpu_peak.md, the weight-gradient products (how many, "
            "where the first runs) and where the last torch_pallas kernel runs, as a share of the program's "
            "instructions in order (— in rows measured before the schedule was read). Compile only; a diagnosis "
            "of where a peak ratio comes from, not what torch_xla 2.9 users get. Rows come from several runs "
            "(one `--layers` each, some side by side): compile-only figures do not depend on the machine's "
            "load.\n\n"
            + markdown_table(["model", "layers", "attention", "generation", "variant"]
                             + [header for version in (pinned, NEWER_LIBTPU)
                                for header in (f"libtpu {version}: peak", "products: count, first at",
                                               "last kernel at")], rows))


def main():
    if sys.argv[1:2] == ["--compile-proto"]:
        return compile_proto(*sys.argv[2:4])
    import bench_tpu_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert-128"], choices=sorted(bench_tpu_step.MODELS))
    parser.add_argument("--attentions", nargs="+", default=["sdpa"], choices=bench_tpu_step.ATTENTIONS)
    parser.add_argument("--variants", nargs="+", default=["torch", "torch_pallas tiled"],
                        choices=bench_tpu_step.VARIANTS)
    parser.add_argument("--generations", nargs="+", default=["v6e"])
    parser.add_argument("--layers", type=int, default=bench_tpu_step.LAYERS)
    args = parser.parse_args()
    if not TORCHAX_PYTHON.exists():
        sys.exit(f"needs the torchax stack's environment at {TORCHAX_PYTHON} "
                 "(TORCH_PALLAS_STACK=torchax ./dev test --co sets it up)")
    records = measure(args.models, args.attentions, args.variants, args.generations, args.layers)
    RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS_JSON, "a") as lock:  # as bench_tpu_step.save: runs side by side keep each other's rows
        fcntl.flock(lock, fcntl.LOCK_EX)
        text = RESULTS_JSON.read_text()
        records = merged_rows(json.loads(text)["results"] if text.strip() else [], records, _key)
        table = render(records)
        write("tpu_step_newer_libtpu", {"mode": "compile only", "results": records}, table, None)
    print(table)


if __name__ == "__main__":
    main()
