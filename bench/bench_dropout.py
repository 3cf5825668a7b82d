"""Dropout: torch_pallas.dropout vs torch's dropout on the same XLA device and torch's CPU eager
dropout, forward and forward+backward, float32 and bfloat16, 2**16 to 2**24 elements.

Floor (per element, forward+backward): read x, write y, read the gradient, write its input
gradient: 4 passes of the dtype's bytes, plus the noise drawn twice (forward and backward): with
the default impl, tiled, a quarter of a Threefry-2x32-13 hash per element; with threefry one
Threefry-2x32-20 hash (~120 uint32 vector ops, counted in bench/results/tpu_cost.md). torch's
dropout moves 1 more byte per element (the saved mask) each way and draws its noise once. Both
floors are measured here, on the same XLA device: the memory floor is 2x the time of ``x * 2``
(one read and one write pass), the noise floor 2x the time of ``torch_pallas.random.uniform`` of
the same shape with the default impl (its noise work plus one write).
"""

from __future__ import annotations

import torch
import torch_xla

import torch_pallas
from common import Timing, markdown_table, ratio, time_host, time_xla, write

P = 0.1


def saved_bytes(dropout, x) -> int:
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        dropout(x)
    return total


def implementations():
    return {
        # The default impl: tiled since 2026-11-28 (threefry before), beside threefry.
        "torch_pallas (XLA)": (lambda x: torch_pallas.dropout(x, P), "xla"),
        "torch_pallas threefry (XLA)": (lambda x: torch_pallas.dropout(x, P, impl="threefry"), "xla"),
        "torch F.dropout (XLA)": (lambda x: torch.nn.functional.dropout(x, P), "xla"),
        "torch F.dropout (CPU eager)": (lambda x: torch.nn.functional.dropout(x, P), "cpu"),
    }


def measure_floors(shape, dtype, repeats):
    x = torch.randn(shape, dtype=dtype).to(torch_xla.device())
    copy = time_xla(lambda: x * 2, repeats=repeats)
    impl = torch_pallas.random.get_default_impl("dropout")
    noise = time_xla(lambda: torch_pallas.random.uniform(shape, dtype=dtype, seed=0, impl=impl), repeats=repeats)
    return {"memory_floor_ms": 2 * copy.min_ms, "noise_floor_ms": 2 * noise.min_ms,
            "copy_GBps": 2 * x.numel() * x.element_size() / copy.min_ms / 1e6}


def measure(sizes, dtypes, repeats):
    rows = []
    for dtype in dtypes:
        for size in sizes:
            shape = (size // 1024, 1024)
            floors = measure_floors(shape, dtype, repeats)
            for name, (dropout, device) in implementations().items():
                x = torch.randn(shape, dtype=dtype).to(torch_xla.device() if device == "xla" else "cpu")
                x.requires_grad_()
                gradient = torch.ones_like(x)

                def forward():
                    return dropout(x.detach())

                def forward_backward():
                    x.grad = None
                    y = dropout(x)
                    y.backward(gradient)
                    return y, x.grad  # both stay live, as in training

                timer = time_xla if device == "xla" else time_host
                rows.append({
                    "implementation": name, "dtype": str(dtype).removeprefix("torch."), "elements": size,
                    "forward": timer(forward, repeats=repeats),
                    "forward_backward": timer(forward_backward, repeats=repeats),
                    "saved_bytes": saved_bytes(dropout, x),
                    **(floors if name == "torch_pallas (XLA)" else {}),
                })
    return rows


def report(rows, mode):
    reference = {(r["dtype"], r["elements"]): r for r in rows if r["implementation"] == "torch F.dropout (XLA)"}
    table = []
    for r in rows:
        ref = reference[(r["dtype"], r["elements"])]
        table.append([r["implementation"], r["dtype"], f"2^{r['elements'].bit_length() - 1}",
                      r["forward"].median_ms, ratio(r["forward"].median_ms, ref["forward"].median_ms),
                      r["forward_backward"].median_ms, r["forward_backward"].min_ms,
                      ratio(r["forward_backward"].median_ms, ref["forward_backward"].median_ms),
                      r["saved_bytes"], r["forward"].compile_s + r["forward_backward"].compile_s,
                      r["forward"].compiles_after_warmup + r["forward_backward"].compiles_after_warmup])
    md = markdown_table(
        ["implementation", "dtype", "elements", "fwd ms", "fwd ratio", "fwd+bwd ms", "fwd+bwd ms (min)",
         "fwd+bwd ratio",
         "bytes saved for backward", "compile s (warm-up)", "compiles after warm-up"], table)
    floors = [[r["dtype"], f"2^{r['elements'].bit_length() - 1}", r["forward_backward"].min_ms,
               r["memory_floor_ms"], r["noise_floor_ms"], r["copy_GBps"],
               r["forward_backward"].min_ms / max(r["memory_floor_ms"], r["noise_floor_ms"])]
              for r in rows if "memory_floor_ms" in r]
    md += ("\nRatios are to torch's own dropout on the same XLA device (lower is faster), from medians; "
           "compile time is reported separately. fwd+bwd materialises both the output and the input gradient. Target: torch_pallas fwd+bwd ratio <= 1.0 "
           "(aim 0.6) at 2^22 elements.\n")
    md += ("\nFloors of torch_pallas's fwd+bwd, measured in the same run (min times): memory = 4 passes "
           "of the tensor at the bandwidth of `x * 2` on the same device; noise = 2 draws of the default "
           f"impl's noise ({torch_pallas.random.get_default_impl('dropout')}), 2x `torch_pallas.random.uniform` of "
           "the same shape with it (32-bit uniforms: for the tiled impl twice the hashes of dropout's 16-bit ones). "
           "The larger one is the floor. `torch_pallas (XLA)`: the default impl.\n\n")
    md += markdown_table(["dtype", "elements", "torch_pallas fwd+bwd ms (min)", "memory floor ms", "noise floor ms",
                          "copy GB/s", "fwd+bwd / floor"], floors)

    def plot(path):
        import matplotlib.pyplot as plt

        dtypes = sorted({r["dtype"] for r in rows})
        figure, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
        for axis, dtype in zip(axes[0], dtypes):
            for name in implementations():
                points = [(r["elements"], r["forward_backward"].median_ms) for r in rows
                          if r["implementation"] == name and r["dtype"] == dtype]
                axis.plot(*zip(*points), marker="o", label=name)
            axis.set(xscale="log", yscale="log", xlabel="elements", ylabel="fwd+bwd time (ms, median)",
                     title=f"dropout p={P}, {dtype}")
            axis.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=100)

    write("dropout", {"mode": mode, "p": P, "rows": rows}, md, plot)
    return md


def run(full: bool):
    sizes = [2**k for k in (range(16, 25, 2) if full else (16, 18, 20, 22))]
    rows = measure(sizes, [torch.float32, torch.bfloat16], repeats=15 if full else 7)
    return report(rows, "full" if full else "quick")
