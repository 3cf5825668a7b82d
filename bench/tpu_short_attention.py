"""Attention over few keys on the TPU compiler: the flash kernels against XLA's own attention.

    .venv/xla/bin/python bench/tpu_short_attention.py                # libtpu 0.0.21: v4, v5e, v5p, v6e
    .venv/torchax/bin/python bench/tpu_short_attention.py            # libtpu 0.0.52: the same (TPU7x's clock
                                                                     # is unpublished: no time for it)

Where the step table's rows with few keys come from (``bench/results/tpu_step.md``: GPT-2 and
BERT at 8 x 128 tokens, ViT-B/16's 197 patches). One program per row, float32 forward+backward
(``jax.vjp``: the output and the gradients of query, key and value for an incoming gradient),
compiled whole for one chip of each generation by the stack's libtpu (compile only, nothing
runs), at the models' attention shapes (B, H, L, E): (8, 12, 128, 64) and (32, 12, 197, 64):

- ``ours``: ``torch_pallas.kernels.attention.attention`` with its default blocks, at dropout_p 0
  and 0.1 with the tiled and hardware impls;
- ``XLA``: softmax attention written in ``jax.numpy`` (``softmax(q @ k.T * scale) @ v``, the
  math path torch's ``scaled_dot_product_attention`` takes on an XLA device), without dropout:
  what XLA makes of it, fused as it chooses;
- each also with its operands as a transformers model holds them, ``(B, L, H * E)`` (the
  projections' output), viewed ``(B, H, L, E)`` for the attention and the output viewed back:
  the copies XLA adds around a kernel (a Mosaic kernel takes row-major operands, where XLA lays
  out a program's inputs as it prefers: ``f32[32, 197, 768]`` with its batch dim tiled,
  ``{2,0,1}``), or reads through in its own fusions. In a whole step the producers' layouts
  decide what is copied; these programs do not say.

Reported: the whole program's schedule in µs (``tpu_peers.program_schedule``: every fusion and
kernel counted by ``tpu_schedule.executed_schedule``, bundles / clock), its HBM time (bytes the
optimised HLO moves, / published bandwidth), the longer of the two, and peak HBM. Written to
``results/tpu_short_attention.{json,md}``; rows of the other stack (its libtpu) are kept.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import torch_pallas  # noqa: E402,F401  (torch_xla before JAX; pins the Mosaic IR version libtpu accepts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tpu_cost_attention  # noqa: E402
from common import markdown_table  # noqa: E402
from torch_pallas import bridge, tpu_compile  # noqa: E402
from torch_pallas.tpu_schedule import HARDWARE  # noqa: E402

SHAPES = {"GPT-2 / BERT, 128 tokens": (8, 12, 128, 64), "ViT-B/16, 197 patches": (32, 12, 197, 64)}
# (name, dropout_p, impl) of ours; XLA's has no dropout.
OURS = (("ours p=0", 0.0, "threefry"), ("ours p=0.1 tiled", 0.1, "tiled"), ("ours p=0.1 hardware", 0.1, "hardware"))
XLA = "XLA p=0"
LAYOUTS = ("(B, H, L, E)", "(B, L, H*E)")
RESULTS = Path(__file__).parent / "results" / "tpu_short_attention"


def _xla(key, q, k, v):
    del key
    weights = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1]), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, v)


def program(name: str, shape, layout: str):
    """(forward+backward function of (key, q, k, v, grad), its argument specs)."""
    B, H, L, E = shape
    if name == XLA:
        attend = _xla
    else:
        _, dropout_p, impl = next(o for o in OURS if o[0] == name)
        attend = functools.partial(tpu_cost_attention._ours, dropout_p=dropout_p, impl=impl, causal=False)
    if layout == LAYOUTS[0]:
        forward = attend
        spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    else:
        def heads(x):
            return x.reshape(B, L, H, E).transpose(0, 2, 1, 3)

        def forward(key, q, k, v):
            return attend(key, heads(q), heads(k), heads(v)).transpose(0, 2, 1, 3).reshape(B, L, H * E)
        spec = jax.ShapeDtypeStruct((B, L, H * E), jnp.float32)

    def function(key, q, k, v, grad):
        return tpu_cost_attention._vjp(functools.partial(forward, key))(q, k, v, grad)
    return function, (tpu_cost_attention.KEY, spec, spec, spec, spec)


def run(generations):
    libtpu = importlib.metadata.version("libtpu")
    for shape_name, shape in SHAPES.items():
        for name in [o[0] for o in OURS] + [XLA]:
            for layout in LAYOUTS:
                for generation in generations:
                    function, args = program(name, shape, layout)
                    r = tpu_cost_attention.measure(lambda: tpu_cost_attention._compile_jax(function, args, generation),
                                                   generation)
                    hardware = HARDWARE[generation]
                    record = {"stack": bridge.STACK, "libtpu": libtpu, "jax": jax.__version__, "shape": shape_name,
                              "program": name, "layout": layout, "generation": generation,
                              "schedule_us": r["bundles"] / hardware.clock * 1e6,
                              "hbm_us": r["hbm"] / hardware.hbm_bandwidth * 1e6, "peak_bytes": r["peak"],
                              "kernels": [[label, run["bundles"]] for label, run, *_ in r["kernels"]]}
                    print(shape_name, name, layout, generation, f"{record['schedule_us']:.1f} µs",
                          file=sys.stderr, flush=True)
                    yield record


def _place(record):
    return record["libtpu"], record["shape"], record["program"], record["layout"], record["generation"]


def report(records) -> str:
    lines = ["# Attention over few keys: the flash kernels against XLA's own attention", "",
             "Generated by `bench/tpu_short_attention.py` on each stack (its libtpu's compile-only client; nothing ran "
             "on a TPU). float32 forward+backward of softmax attention at each model's attention shape; per "
             "generation: the whole program's schedule / HBM time in µs (the longer, which bounds it, in bold) / peak "
             "MiB. `(B, L, H*E)`: the operands as a transformers model holds them, viewed `(B, H, L, E)` for the "
             "attention, layout copies included (XLA lays out a program's inputs as it prefers, `f32[32, 197, 768]` "
             "with its batch dim tiled, and a Mosaic kernel takes row-major operands: in a step the producers' "
             "layouts decide what is copied). `XLA p=0`: `softmax(q @ k.T * scale) @ v` in jax.numpy, fused as "
             "XLA chooses.", ""]
    for libtpu in sorted({r["libtpu"] for r in records}):
        rows_here = [r for r in records if r["libtpu"] == libtpu]
        generations = [g for g in HARDWARE if any(r["generation"] == g for r in rows_here)]
        first = rows_here[0]
        lines += [f"## libtpu {libtpu} (jax {first['jax']}, the {first['stack']} stack)", ""]
        by = {_place(r): r for r in rows_here}
        rows = []
        for shape_name in SHAPES:
            for name in [o[0] for o in OURS] + [XLA]:
                for layout in LAYOUTS:
                    cells = []
                    for generation in generations:
                        r = by.get((libtpu, shape_name, name, layout, generation))
                        if r is None:
                            cells.append("—")
                            continue
                        schedule, hbm = f"{r['schedule_us']:.1f}", f"{r['hbm_us']:.1f}"
                        schedule, hbm = ((f"**{schedule}**", hbm) if r["schedule_us"] >= r["hbm_us"]
                                         else (schedule, f"**{hbm}**"))
                        cells.append(f"{schedule} / {hbm} / {r['peak_bytes'] / 2**20:.0f}")
                    rows.append([shape_name, name, layout, *cells])
        lines += [markdown_table(["shape", "program", "operands", *generations], rows), ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", nargs="*",
                        default=[g for g in tpu_compile.GENERATIONS if HARDWARE[g].clock is not None])
    options = parser.parse_args()
    tpu_compile.enable_estimates()
    path = RESULTS.with_suffix(".json")
    records = json.loads(path.read_text()) if path.exists() else []
    for record in run(options.generations):
        records = [r for r in records if _place(r) != _place(record)] + [record]
        path.write_text(json.dumps(records, indent=1) + "\n")
    RESULTS.with_suffix(".md").write_text(report(records) + "\n")
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
