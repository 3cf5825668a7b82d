"""Where an eager call's time goes on torch_xla, against the same program in jaxlib.

For IndRNN forward+backward (relu) and for ``lax.scan``'s forward+backward run through
``call_jax``, each call on torch_xla is split into: building the lazy graph (Python, torch's
dispatch, ``call_jax``), ``torch_xla.sync()`` (graph hashing, cache lookup, launch), the
execution (torch_xla's ``ExecuteTime`` metric: launch to buffers ready) and the rest of the
wall time (fetching the result). The same JAX function jitted in jaxlib is timed in the same
rounds, alternating call by call, so that the two execution times can be compared directly:
XLA compiles the same optimised HLO in both (see the IndRNN table's note), so a ratio near 1
means the runtime executes it as fast, and the difference in wall time is the host's.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import jax
import jax.numpy as jnp
import torch
import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.debug.metrics as metrics

import torch_pallas
from torch_pallas.kernels import indrnn as kernels
from bench_indrnn import SCAN_GRADIENTS
from common import markdown_table, result_probe, write

PARTS = ("build the lazy graph", "sync", "execute (ExecuteTime)", "wall")


def _split_call(fn) -> dict:
    """One call of ``fn`` on the XLA device, its wall time split into :data:`PARTS` (ms)."""
    metrics.clear_metrics()
    start = time.perf_counter()
    total = result_probe(fn())
    built = time.perf_counter()
    torch_xla.sync()
    synced = time.perf_counter()
    total.cpu()
    done = time.perf_counter()
    return {"build the lazy graph": (built - start) * 1e3, "sync": (synced - built) * 1e3,
            "execute (ExecuteTime)": _execute_time_ms(), "wall": (done - start) * 1e3}


def _execute_time_ms(timeout_s: float = 1.0) -> float:
    """The one ExecuteTime sample since the metrics were cleared. torch_xla records it from a
    callback when the run's buffers become ready, which can come after the fetch returns."""
    deadline = time.perf_counter() + timeout_s
    while (data := metrics.metric_data("ExecuteTime")) is None and time.perf_counter() < deadline:
        time.sleep(1e-4)
    if data is None or data[0] != 1:
        raise RuntimeError(f"expected one XLA execution per call, ExecuteTime says {data}")
    return data[1] / 1e6


def _measure(T, B, F, repeats):
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((T, B, F), dtype=np.float32)
    g_np = rng.standard_normal((T, B, F), dtype=np.float32)
    w_np = np.ones(F, np.float32)
    device = torch_xla.device()
    x, g = torch.from_numpy(x_np).to(device), torch.from_numpy(g_np).to(device)
    w = torch.from_numpy(w_np).to(device)
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def torch_pallas_both():
        xg.grad = wg.grad = None
        output = torch_pallas.indrnn(xg, wg)[0]
        output.backward(g)
        return output, xg.grad, wg.grad

    h0 = jnp.zeros((B, F), jnp.float32)

    @jax.jit
    def kernels_both(x, w, g):
        output, h_n = kernels.indrnn_forward(x, w, h0, nonlinearity="relu", interpret=True)
        return kernels.indrnn_backward(g, jnp.zeros_like(h_n), output, w, h0, nonlinearity="relu", interpret=True)

    xj, wj, gj = jnp.asarray(x_np), jnp.asarray(w_np), jnp.asarray(g_np)
    pairs = {
        "torch_pallas.indrnn fwd+bwd": (torch_pallas_both, kernels_both, (xj, wj, gj)),
        "lax.scan fwd+bwd via call_jax": (lambda: xb.call_jax(SCAN_GRADIENTS, (x, w, g)), SCAN_GRADIENTS,
                                          (xj.reshape(T, B * F), jnp.tile(wj, B), gj.reshape(T, B * F))),
    }
    rows = []
    for name, (on_xla, in_jax, args) in pairs.items():
        for _ in range(3):
            _split_call(on_xla)
            jax.block_until_ready(in_jax(*args))
        parts, jaxlib = {part: [] for part in PARTS}, []
        for _ in range(repeats):
            for part, ms in _split_call(on_xla).items():
                parts[part].append(ms)
            start = time.perf_counter()
            jax.block_until_ready(in_jax(*args))
            jaxlib.append((time.perf_counter() - start) * 1e3)
        medians = {part: statistics.median(values) for part, values in parts.items()}
        jaxlib_ms = statistics.median(jaxlib)
        rows.append([f"({T}, {B}, {F})", name, *medians.values(), jaxlib_ms,
                     medians["execute (ExecuteTime)"] / jaxlib_ms, medians["wall"] / jaxlib_ms])
    return rows


def run(full: bool):
    repeats = 30 if full else 15
    shapes = [(1000, 1, 1000)] + ([(512, 64, 512)] if full else [])
    rows = [row for shape in shapes for row in _measure(*shape, repeats)]
    md = markdown_table(["shape", "computation", *(f"torch_xla: {part} ms" for part in PARTS),
                         "jaxlib wall ms", "torch_xla execute / jaxlib", "torch_xla wall / jaxlib"], rows)
    md += (f"\nMedians of {repeats} calls; each torch_xla call alternates with a call of the same JAX "
           "function jitted in jaxlib. The torch_xla parts are medians of their own, so they need not add "
           "up to the wall time. 'build the lazy graph' includes putting one element of each output into "
           "the graph so that fetching it waits for the run, as every XLA row of these benchmarks does. "
           "Off TPU the Pallas kernels run in interpret mode.\n")
    write("runtime", {"mode": "full" if full else "quick", "rows": rows}, md, None)
    return md
