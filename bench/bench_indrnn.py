"""IndRNN: torch_pallas.indrnn vs JAX re-implementations of the public benchmark's versions
(a Python loop unrolled under jax.jit, lax.scan, a single-kernel Pallas version with (T, 1) and
(T, 4) blocks, plus (T, F) blocks), a torch loop on the XLA device and torch eager on the CPU.

Shapes: the public benchmark's (T=1000, B=1, F=1000, relu, w=1, h0=0) and a batched
(T=512, B=64, F=512). Floor, forward: read x and write h once: 2*T*B*F*4 bytes (8 MB at the
public shape), and T*B*F fused multiply-add-max operations; forward+backward adds reading the
gradient and the outputs and writing the input gradient: 5*T*B*F*4 bytes in all.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import torch
import torch_xla
import torch_xla.debug.metrics as metrics

import torch_pallas
from common import (Contender, markdown_table, ratio, time_host, time_jax, time_round_robin, time_xla,
                    wait_for_xla, write)

# --- the JAX versions (time-major, x of shape (T, N) with N = B*F; relu) ----------------------


def unrolled_loop(x, w):
    h, outputs = jnp.zeros_like(x[0]), []
    for t in range(x.shape[0]):
        h = jax.nn.relu(x[t] + w * h)
        outputs.append(h)
    return jnp.stack(outputs)


def scan(x, w):
    def step(h, x_t):
        h = jax.nn.relu(x_t + w * h)
        return h, h

    return jax.lax.scan(step, jnp.zeros_like(x[0]), x)[1]


def _single_kernel(x_ref, w_ref, o_ref):
    def step(t, h):
        h = jnp.maximum(x_ref[t] + w_ref[0] * h, 0.0)
        o_ref[t] = h
        return h

    jax.lax.fori_loop(0, x_ref.shape[0], step, jnp.zeros_like(w_ref[0]))


def pallas_single_kernel(x, w, *, block_features):
    """The benchmark post's Pallas version: one kernel instance per (T, block_features) block
    runs the whole time loop. Interpret mode off TPU."""
    T, N = x.shape
    return pl.pallas_call(
        _single_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(pl.cdiv(N, block_features),),
        in_specs=[pl.BlockSpec((T, block_features), lambda i: (0, i)),
                  pl.BlockSpec((1, block_features), lambda i: (0, i))],
        out_specs=pl.BlockSpec((T, block_features), lambda i: (0, i)),
        interpret=jax.default_backend() != "tpu",
    )(x, w[None])


def jax_backward(forward):
    def loss(x, w, g):
        return jnp.sum(forward(x, w) * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


# call_jax caches by function identity: module level, made once.
SCAN_GRADIENTS = jax_backward(scan)

TORCH_PALLAS = "torch_pallas.indrnn (XLA)"
SCAN_VIA_CALL_JAX = "jax lax.scan via call_jax (XLA)"
KERNELS_FROM_JAX = "torch_pallas kernels from JAX (no bridge)"
SCAN = "jax lax.scan"


# --- torch versions ------------------------------------------------------------------------


def torch_loop(x, w):
    h, outputs = torch.zeros_like(x[0]), []
    for x_t in x:
        h = torch.relu(x_t + w * h)
        outputs.append(h)
    return torch.stack(outputs)


def measure_shape(T, B, F, *, full, repeats):
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((T, B, F), dtype=np.float32)
    w_np = np.ones(F, np.float32) if B == 1 else rng.uniform(0, 1, F).astype(np.float32)
    g_np = rng.standard_normal((T, B, F), dtype=np.float32)

    # torch_pallas on the XLA device.
    device = torch_xla.device()
    x = torch.from_numpy(x_np).to(device).requires_grad_()
    w = torch.from_numpy(w_np).to(device).requires_grad_()
    g = torch.from_numpy(g_np).to(device)

    def tp_forward_backward():
        x.grad = w.grad = None
        output = torch_pallas.indrnn(x, w)[0]
        output.backward(g)
        return output, x.grad, w.grad

    # The same kernels called from JAX directly: the kernel's cost without the torch bridge.
    from torch_pallas.kernels import indrnn as kernels

    interpret = jax.default_backend() != "tpu"
    xk, wk, gk = jnp.asarray(x_np), jnp.asarray(w_np), jnp.asarray(g_np)
    h0k = jnp.zeros((B, F), jnp.float32)

    def kernel_forward(x, w):
        return kernels.indrnn_forward(x, w, h0k, nonlinearity="relu", interpret=interpret)

    def kernel_both(x, w, g):
        output, h_n = kernel_forward(x, w)
        return kernels.indrnn_backward(g, jnp.zeros_like(h_n), output, w, h0k, nonlinearity="relu",
                                       interpret=interpret)

    # The JAX versions take (T, N).
    x2, g2 = jnp.asarray(x_np.reshape(T, B * F)), jnp.asarray(g_np.reshape(T, B * F))
    w2 = jnp.asarray(np.tile(w_np, B))

    # The four rows the targets compare are timed round-robin. lax.scan also runs on the same
    # XLA device through call_jax: the same runtime as torch_pallas.
    import torch_xla.core.xla_builder as xb

    forward = time_round_robin({
        TORCH_PALLAS: Contender.xla(lambda: torch_pallas.indrnn(x.detach(), w.detach())[0]),
        SCAN_VIA_CALL_JAX: Contender.xla(lambda: xb.call_jax(scan, (x.detach(), w.detach()))),
        KERNELS_FROM_JAX: Contender.jax(jax.jit(kernel_forward), xk, wk),
        SCAN: Contender.jax(jax.jit(scan), x2, w2),
    }, repeats=repeats)
    forward_backward = time_round_robin({
        TORCH_PALLAS: Contender.xla(tp_forward_backward),
        SCAN_VIA_CALL_JAX: Contender.xla(lambda: xb.call_jax(SCAN_GRADIENTS, (x.detach(), w.detach(), g))),
        KERNELS_FROM_JAX: Contender.jax(jax.jit(kernel_both), xk, wk, gk),
        SCAN: Contender.jax(SCAN_GRADIENTS, x2, w2, g2),
    }, repeats=repeats)
    results = {name: (forward[name], forward_backward[name]) for name in forward}
    for block in (B * F, 4, 1):
        label = f"jax Pallas single kernel, (T, {block}) blocks"
        few = 1 if block < 8 else repeats  # thousands of interpret-mode grid steps: slow
        forward = jax.jit(functools.partial(pallas_single_kernel, block_features=block))
        results[label] = (time_jax(forward, x2, w2, warmup=1, repeats=few), None)
    unrolled_T = T if full else min(T, 100)
    if unrolled_T == T:
        results["jax unrolled loop (jit)"] = (time_jax(jax.jit(unrolled_loop), x2, w2, warmup=1, repeats=3), None)
    else:
        results[f"jax unrolled loop (jit), T={unrolled_T} only"] = (
            time_jax(jax.jit(unrolled_loop), x2[:unrolled_T], w2, warmup=1, repeats=3), None)

    # A torch loop on the XLA device: T lazy steps in one graph, which compiles like the
    # unrolled loop (20-40 s at T=100; still compiling after 15 min at T=1000), so T=100 only.
    loop_T = min(T, 100)
    xl = x[:loop_T].detach().clone().requires_grad_()
    gl = g[:loop_T]
    torch_xla.sync()

    def loop_forward():
        return torch_loop(xl.detach(), w.detach())

    def loop_forward_backward():
        xl.grad = w.grad = None
        output = torch_loop(xl, w)
        output.backward(gl)
        return output, xl.grad, w.grad

    suffix = "" if loop_T == T else f", T={loop_T} only"
    results[f"torch loop (XLA){suffix}"] = (time_xla(loop_forward, warmup=1, repeats=3),
                                            time_xla(loop_forward_backward, warmup=1, repeats=3))

    # torch eager on the CPU.
    xc = torch.from_numpy(x_np).requires_grad_()
    wc = torch.from_numpy(w_np).requires_grad_()
    gc = torch.from_numpy(g_np)

    def cpu_forward_backward():
        xc.grad = wc.grad = None
        torch_loop(xc, wc).backward(gc)

    with torch.no_grad():
        cpu_forward = time_host(lambda: torch_loop(xc, wc), repeats=repeats)
    results["torch loop (CPU eager)"] = (cpu_forward, time_host(cpu_forward_backward, repeats=repeats))
    return results


def compile_times(full):
    """Compile time against T: torch_pallas (forward+backward graph) vs lax.scan vs the unrolled loop."""
    rows = []
    F = 1000
    for T in (1000, 10000):
        x = torch.randn(T, 1, F).to(torch_xla.device()).requires_grad_()
        w = torch.ones(F).to(torch_xla.device()).requires_grad_()
        count, seconds = metrics.metric_data("CompileTime")[:2] if metrics.metric_data("CompileTime") else (0, 0)
        torch_pallas.indrnn(x, w)[0].sum().backward()
        wait_for_xla([x.grad, w.grad])
        count2, seconds2 = metrics.metric_data("CompileTime")[:2]
        rows.append(["torch_pallas.indrnn fwd+bwd (XLA compile)", T, (seconds2 - seconds) / 1e9])
        xs, ws = jnp.zeros((T, F)), jnp.ones(F)
        jax.clear_caches()  # measure a compile, not a cache hit
        start = time.perf_counter()
        jax.jit(scan).lower(xs, ws).compile()
        rows.append(["jax lax.scan forward (lower+compile)", T, time.perf_counter() - start])
    for T in (100, 200):  # full mode adds T=1000 from its one measured run (an 11-minute compile)
        xs, ws = jnp.zeros((T, F)), jnp.ones(F)
        jax.clear_caches()
        start = time.perf_counter()
        jax.jit(unrolled_loop).lower(xs, ws).compile()
        rows.append(["jax unrolled loop forward (lower+compile)", T, time.perf_counter() - start])
    return rows


def run(full: bool):
    repeats = 15 if full else 9
    shapes = {"public (T=1000, B=1, F=1000)": (1000, 1, 1000), "batched (T=512, B=64, F=512)": (512, 64, 512)}
    measured = {label: measure_shape(*shape, full=full, repeats=repeats) for label, shape in shapes.items()}
    compiles = compile_times(full)
    unrolled_full = measured["public (T=1000, B=1, F=1000)"].get("jax unrolled loop (jit)")
    if unrolled_full is not None:
        compiles.append(["jax unrolled loop forward (first call - run time)", 1000, unrolled_full[0].compile_s])

    table = []
    for label, results in measured.items():
        scan_forward, scan_backward = results[SCAN]
        xla_scan_forward, xla_scan_backward = results[SCAN_VIA_CALL_JAX]
        for name, (forward, forward_backward) in results.items():
            on_xla = "(XLA" in name
            table.append([label, name, forward.median_ms, forward.min_ms,
                          ratio(forward.median_ms, scan_forward.median_ms),
                          forward_backward.median_ms if forward_backward else None,
                          forward_backward.min_ms if forward_backward else None,
                          ratio(forward_backward.median_ms, scan_backward.median_ms) if forward_backward else None,
                          ratio(forward_backward.median_ms, (xla_scan_backward if on_xla else scan_backward).median_ms)
                          if forward_backward else None,
                          forward.compile_s + (forward_backward.compile_s if forward_backward else 0.0)])
    md = markdown_table(["shape", "implementation", "fwd ms (median)", "fwd ms (min)", "fwd / scan",
                         "fwd+bwd ms (median)", "fwd+bwd ms (min)", "fwd+bwd / scan",
                         "fwd+bwd / scan, same runtime", "compile s (warm-up)"], table)
    runtime_ratios = " and ".join(
        f"{results[SCAN_VIA_CALL_JAX][1].median_ms / results[SCAN][1].median_ms:.2f}x" for results in measured.values())
    md += ("\nRatios are to the jitted `lax.scan` version on the same machine (lower is faster); the "
           "'same runtime' column compares rows marked (XLA) with `lax.scan` run through `call_jax` on the "
           f"same XLA device, because there the identical scan took {runtime_ratios} the time it takes in "
           "jaxlib (fwd+bwd, the two shapes): XLA runs the same optimised HLO as fast in both, and torch_xla "
           "adds its host cost per call (lazy tracing, graph hashing, fetching the result). The first four rows of each "
           f"shape were timed round-robin ({repeats} rounds, each running all four once), so a slow phase of "
           "the machine falls on all four alike; the other rows were timed one after another. fwd+bwd "
           "for JAX versions is `jax.grad` of sum(h * g) w.r.t. (x, w). The single-kernel Pallas version "
           "and the unrolled loop are forward only, as in the public benchmark. Off TPU every Pallas kernel "
           "runs in interpret mode.\n\nCompile time against sequence length (F = 1000, B = 1):\n\n")
    md += markdown_table(["implementation", "T", "compile s"], compiles)

    def plot(path):
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for axis, (label, results) in zip(axes, measured.items()):
            names = list(results)
            forward = [results[n][0].median_ms for n in names]
            both = [results[n][1].median_ms if results[n][1] else 0 for n in names]
            positions = np.arange(len(names))
            axis.barh(positions - 0.2, forward, 0.4, label="forward")
            axis.barh(positions + 0.2, both, 0.4, label="forward+backward")
            axis.set(yticks=positions, yticklabels=names, xscale="log", xlabel="ms (median)", title=label)
            axis.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=100)

    write("indrnn", {"mode": "full" if full else "quick",
                     "shapes": {label: {name: [t.as_dict() if t else None for t in pair] for name, pair in results.items()}
                                for label, results in measured.items()},
                     "compile_times": compiles}, md, plot)
    return md
