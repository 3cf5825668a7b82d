"""What libtpu's compiler says the fused dropout_linear kernels cost at LoRA's ranks, against the
HBM floor of reading ``x``, on a machine without a TPU.

    .venv/xla/bin/python bench/tpu_cost_lora.py                      # v4, v5e, v5p, v6e; ranks 8 to 64
    .venv/xla/bin/python bench/tpu_cost_lora.py --generations v6e    # one generation

``x`` is LoRA's input to ``lora_A(dropout(x))`` in the step of ``tpu_step.md``'s LoRA rows: 4 x 1024
tokens of width 1024 in bfloat16, read by the kernels beside PEFT's float32 adapter (the kernels
take the bfloat16 ``x`` as ``x.to(float32)``: ``kernels.dropout_linear.widens``), at ranks 8, 16,
32 and 64, with the default noise impl (``"tiled"``) and blocks. Each kernel (the forward,
``dropout(x) @ A.T``; the backward, ``x``'s gradient and the adapter's) is compiled alone by
libtpu's compile-only client and costed by :func:`torch_pallas.tpu_compile.analyze_for_tpu`'s
estimate: for each op of the compiled program the longer of its bundles at the clock and its
HBM bytes at the bandwidth (``tpu_schedule.StepEstimate``); the program's own launch bundles are
left out (``kernel us`` is the kernel's op alone).

The floors are bytes at the published HBM bandwidth (``tpu_schedule.HARDWARE``): ``x floor``
reads ``x`` once (8 MiB), the least any kernel that drops ``x`` can move; ``all operands`` adds
what the kernel must also move: forward the adapter (read) and the output (written), backward
the output's gradient (read), ``x``'s gradient (written, bfloat16) and the adapter's (written,
float32). ``noise floor`` is the vector work of the mask alone
(``common.mask_noise_floor_seconds``: the tiled impl's integer ops per element at every vector-ALU
slot of every TensorCore). ``without noise`` is an ablation, not a usable kernel: the same kernels
compiled with the hash replaced by constant bits (every element kept), what they would cost if
the mask were free. Compiler estimates, not measurements: nothing here
ran on a TPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from unittest import mock

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_pallas  # noqa: E402,F401  (torch_xla before JAX; pins the Mosaic IR version libtpu accepts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import markdown_table, mask_noise_floor_seconds, write  # noqa: E402
from torch_pallas import tpu_compile  # noqa: E402
from torch_pallas.kernels import dropout_linear, prng  # noqa: E402
from torch_pallas.tpu_schedule import HARDWARE  # noqa: E402

tpu_compile.enable_estimates()

ROWS, FEATURES = 4096, 1024
RANKS = (8, 16, 32, 64)
GENERATIONS = ("v4", "v5e", "v5p", "v6e")
KEY = jax.ShapeDtypeStruct((2,), jnp.int32)
X = jax.ShapeDtypeStruct((ROWS, FEATURES), jnp.bfloat16)


def _forward(key_data, x, weight):
    return dropout_linear.dropout_linear_forward(key_data, x, weight, p=0.1, interpret=False)


def _backward(key_data, x, weight, grad_out):
    return dropout_linear.dropout_linear_backward(key_data, x, weight, grad_out, p=0.1, interpret=False)


def _constant_bits(impl, key_data_ref, chunk_shape, *args, **options):
    """The ablation's stand-in for ``prng.chunk_bits``: bits that keep every element, still read
    from the key (so that nothing folds the kernel's mask away)."""
    return jnp.full(chunk_shape, 0xFFFF0000, jnp.uint32) | key_data_ref[0].astype(jnp.uint32)


def kernel_seconds(function, *args, generation: str, noise: bool = True) -> float:
    """The estimated time of ``function``'s Mosaic kernel alone (its op in the compiled program);
    without ``noise``, of the ablation (:func:`_constant_bits`)."""
    # A fresh callable: JAX's caches must not serve one variant's trace to the other.
    function = functools.partial(function)
    with contextlib.nullcontext() if noise else mock.patch.object(prng, "chunk_bits", _constant_bits):
        estimate = tpu_compile.analyze_for_tpu(function, *args, generation=generation).estimate
    kernels = [op for op in estimate.ops if op.kind == "kernel"]
    assert len(kernels) == 1, [op.name for op in estimate.ops]
    return kernels[0].seconds


def row(generation: str, rank: int) -> dict:
    bandwidth = HARDWARE[generation].hbm_bandwidth
    weight = jax.ShapeDtypeStruct((rank, FEATURES), jnp.float32)
    out = jax.ShapeDtypeStruct((ROWS, rank), jnp.float32)
    x_bytes, weight_bytes, out_bytes = ROWS * FEATURES * 2, rank * FEATURES * 4, ROWS * rank * 4
    seconds = {f"{name}{suffix}": kernel_seconds(function, *args, generation=generation, noise=noise) * 1e6
               for name, function, args in (("forward_us", _forward, (KEY, X, weight)),
                                            ("backward_us", _backward, (KEY, X, weight, out)))
               for suffix, noise in (("", True), ("_without_noise", False))}
    return {"generation": generation, "rank": rank, "x_floor_us": x_bytes / bandwidth * 1e6,
            "noise_floor_us": mask_noise_floor_seconds(generation, ROWS * FEATURES) * 1e6,
            "forward_operands_us": (x_bytes + weight_bytes + out_bytes) / bandwidth * 1e6,
            "backward_operands_us": (2 * x_bytes + 2 * weight_bytes + out_bytes) / bandwidth * 1e6, **seconds}


def table(rows: list) -> str:
    headers = ("generation", "rank", "x floor us", "noise floor us", "forward us", "/ x floor", "without noise us",
               "backward us", "/ all operands", "without noise us")
    return markdown_table(headers, [
        (r["generation"], r["rank"], r["x_floor_us"], r["noise_floor_us"], r["forward_us"],
         r["forward_us"] / r["x_floor_us"], r["forward_us_without_noise"], r["backward_us"],
         r["backward_us"] / r["backward_operands_us"], r["backward_us_without_noise"]) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", nargs="+", default=GENERATIONS, choices=GENERATIONS)
    args = parser.parse_args()
    rows = [row(generation, rank) for generation in args.generations for rank in RANKS]
    markdown = (f"The fused dropout_linear kernels on LoRA's input: x ({ROWS}, {FEATURES}) bfloat16, a float32 "
                f"adapter of rank 8 to 64, impl \"tiled\", compiled alone by libtpu's compile-only client; "
                f"the kernel's estimated time (the longer of its schedule and its HBM bytes at the bandwidth) "
                f"against the floor of reading x once and against all the bytes the kernel must move; the noise "
                f"floor (the mask's hash at the vector units' peak) and the kernels without their noise (an "
                f"ablation: constant bits) (`bench/tpu_cost_lora.py`'s docstring). Compiler estimates, not "
                f"measurements.\n\n" + table(rows))
    write("tpu_cost_lora", {"mode": "compile only", "rows": rows}, markdown, plot=None)
    print(markdown)


if __name__ == "__main__":
    main()
