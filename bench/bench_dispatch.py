"""Host time per eager call: what building the lazy graph costs in Python and torch's
dispatch, apart from XLA's compile and run (issue #19, item 5).

Every contender below is a function that builds a lazy graph (forward, or forward and
``.backward()``) and returns its outputs. Only that building is timed; each call is then
synced and one element of each output fetched (:func:`common.wait_for_xla`), untimed, so the
next starts from an empty graph. Contenders are timed round-robin in one process, each round
running every contender of its group once, after warm-up (which compiles every graph).

- ``dropout``: a chain of 20 ``h = dropout(h, 0.1) + 1`` on an (8, 128, 256) float32
  activation that requires grad; per call = (chain time - the same chain without dropout,
  ``h = h + 1``) / 20. Forward, and forward + ``h.sum().backward()``. Peer: ``F.dropout``.
- ``random.uniform``: the same with ``h = h + uniform(h.shape)``; peer: ``torch.rand``.
- ``indrnn`` (T, B, F) = (16, 8, 256), relu: one call (forward; forward + ``backward(g)``);
  peer: one ``call_jax`` of a jitted ``lax.scan`` recurrence (forward; its ``jax.grad``,
  which computes forward and backward in one call).
- GPT-2 step (6 layers, width 256, batch 8 x 128, eager attention, 19 dropouts of 0.1):
  forward, loss and ``backward()`` (no optimizer update: its graph is the same in every
  variant) with torch's dropout, with every dropout in torch_pallas (``convert_dropout`` and
  ``route_dropout``), and with dropout off (the model in eval mode).

"old path" rows call the ops as torch_pallas did before #19: every call through the custom op's
dispatch (its autograd kernel, redispatch and backend kernel) and the kernel through one
``call_jax``, both monkeypatched in for those rows only, so the before/after comparison comes
from the same process and rounds. The public functions' checks are today's in both.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import jax
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_builder as xb

import torch_pallas
from torch_pallas import bridge, seeds
from torch_pallas.frontends import xla as xla_front_end
from torch_pallas.ops import _autograd
from bench_indrnn import SCAN_GRADIENTS, scan
from common import markdown_table, wait_for_xla, write

CHAIN, SHAPE, P = 20, (8, 128, 256), 0.1
INDRNN_SHAPE = (16, 8, 256)


def _old_call_in_graph(jax_function, tensors, static):
    """bridge's XLA path before #19 item 1: one ``call_jax`` per call."""
    return xb.call_jax(jax_function, tensors, dict(static, interpret=bridge.interpret_mode()))


@contextlib.contextmanager
def old_path(enabled: bool = True):
    """Calls go through the custom ops and ``call_jax``, as before #19."""
    if not enabled:
        yield
        return
    new_call, xla_front_end.call = xla_front_end.call, _old_call_in_graph
    new_choice, _autograd._through_op = _autograd._through_op, lambda args: True
    try:
        yield
    finally:
        xla_front_end.call, _autograd._through_op = new_call, new_choice


def host_round_robin(contenders: dict, *, warmup: int, rounds: int) -> dict:
    """``{name: build}`` -> ``{name: [ms, ...]}``: the time of each ``build()`` (which returns
    the tensors of the graph it built), timed alone; its graph is run and an element fetched
    after the clock stops."""
    samples = {name: [] for name in contenders}
    for round_ in range(warmup + rounds):
        for name, build in contenders.items():
            start = time.perf_counter()
            outputs = build()
            elapsed = (time.perf_counter() - start) * 1e3
            wait_for_xla(outputs)
            if round_ >= warmup:
                samples[name].append(elapsed)
    return samples


def _chain_contenders(device):
    """The chains of :data:`CHAIN` steps; names '<op> fwd' / '<op> fwd+bwd'."""
    x = torch.randn(SHAPE, device=device).requires_grad_()
    wait_for_xla(x)
    steps = {
        "none": lambda h: h + 1,
        "F.dropout": lambda h: F.dropout(h, P) + 1,
        "torch_pallas.dropout": lambda h: torch_pallas.dropout(h, P) + 1,
        "torch_pallas.dropout (old path)": lambda h: torch_pallas.dropout(h, P) + 1,
        "key draw (torch.randint)": lambda h: (seeds.key_data(device=device), h + 1)[1],
        "torch.rand": lambda h: h + torch.rand(SHAPE, device=device),
        "torch_pallas.random.uniform": lambda h: h + torch_pallas.random.uniform(SHAPE, device=device),
        "torch_pallas.random.uniform (old path)": lambda h: h + torch_pallas.random.uniform(SHAPE, device=device),
    }

    def contender(name, step, backward):
        def build():
            x.grad = None
            with old_path("old path" in name):
                h = x
                for _ in range(CHAIN):
                    h = step(h)
                if backward:
                    h.sum().backward()
                    return [h, x.grad]
            return [h]

        return build

    return {f"{name} {kind}": contender(name, step, kind == "fwd+bwd")
            for kind in ("fwd", "fwd+bwd") for name, step in steps.items()}


def _indrnn_contenders(device):
    T, B, Fe = INDRNN_SHAPE
    x = torch.randn(T, B, Fe, device=device).requires_grad_()
    w = torch.rand(Fe, device=device).requires_grad_()
    g = torch.randn(T, B, Fe, device=device)
    wait_for_xla([x, w, g])

    def pallas(backward, old):
        def build():
            x.grad = w.grad = None
            with old_path(old):
                output = torch_pallas.indrnn(x, w)[0]
                if backward:
                    output.backward(g)
                    return [output, x.grad, w.grad]
            return [output]

        return build

    def autograd_floor():
        x.grad = w.grad = None
        output = x * w
        output.backward(g)
        return [output, x.grad, w.grad]

    xd, wd = x.detach(), w.detach()
    return {
        "x * w (autograd floor) fwd+bwd": autograd_floor,
        "torch_pallas.indrnn fwd": pallas(False, False),
        "torch_pallas.indrnn (old path) fwd": pallas(False, True),
        "call_jax(lax.scan) fwd": lambda: [xb.call_jax(scan, (xd, wd))],
        "torch_pallas.indrnn fwd+bwd": pallas(True, False),
        "torch_pallas.indrnn (old path) fwd+bwd": pallas(True, True),
        "call_jax(grad of lax.scan) fwd+bwd": lambda: list(xb.call_jax(SCAN_GRADIENTS, (xd, wd, g))),
    }


def _gpt2_contenders():
    from bench_tpu_step import model_and_batch

    model, ids = model_and_batch()
    pallas_model = torch_pallas.convert_dropout(copy.deepcopy(model))

    def step(model, train, routed, old):
        def build():
            model.train(train).zero_grad(set_to_none=True)
            with (torch_pallas.route_dropout() if routed else contextlib.nullcontext()), old_path(old):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            return [loss, *(parameter.grad for parameter in model.parameters())]

        return build

    return {
        "GPT-2 step, torch dropout": step(model, True, False, False),
        "GPT-2 step, torch_pallas dropout": step(pallas_model, True, True, False),
        "GPT-2 step, torch_pallas dropout (old path)": step(pallas_model, True, True, True),
        "GPT-2 step, torch_pallas dropout, convert_dropout only": step(pallas_model, True, False, False),
        "GPT-2 step, dropout off (eval mode)": step(model, False, False, False),
    }


def _machine_load() -> str:
    """Whether a pytest process runs beside this one, and the load average: the machine is shared."""
    import os
    from pathlib import Path

    pytest = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if b"pytest" in (proc / "cmdline").read_bytes():
                    pytest.append(proc.name)
            except OSError:
                pass
    return (f"pytest processes running: {len(pytest)}; load average "
            f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def _stats(values):
    return statistics.median(values), min(values)


def run(full: bool) -> str:
    rounds, gpt2_rounds = (150, 20) if full else (10, 3)
    device = torch_xla.device()
    torch.manual_seed(0)
    rows, raw = [], {}
    load_before = _machine_load()

    chains = host_round_robin(_chain_contenders(device), warmup=3, rounds=rounds)
    raw.update(chains)
    peers = {"torch_pallas.dropout": "F.dropout", "torch_pallas.dropout (old path)": "F.dropout",
             "key draw (torch.randint)": "F.dropout", "torch_pallas.random.uniform": "torch.rand",
             "torch_pallas.random.uniform (old path)": "torch.rand"}
    for kind in ("fwd", "fwd+bwd"):
        base = chains[f"none {kind}"]

        def per_call(name):
            samples = chains[f"{name} {kind}"]
            # median of the per-round differences; min: best chain less best baseline
            return (statistics.median(s - b for s, b in zip(samples, base)) / CHAIN,
                    (min(samples) - min(base)) / CHAIN)

        for name in ("F.dropout", "torch_pallas.dropout", "torch_pallas.dropout (old path)",
                     "key draw (torch.randint)", "torch.rand", "torch_pallas.random.uniform",
                     "torch_pallas.random.uniform (old path)"):
            median, minimum = per_call(name)
            peer = peers.get(name)
            peer_median = per_call(peer)[0] if peer else None
            rows.append([name, kind, "per call: chain of 20 less baseline", median, minimum,
                         peer or "—", median / peer_median if peer and peer_median > 0 else None])

    indrnn = host_round_robin(_indrnn_contenders(device), warmup=3, rounds=rounds)
    raw.update(indrnn)
    for kind, peer in (("fwd", "call_jax(lax.scan) fwd"), ("fwd+bwd", "call_jax(grad of lax.scan) fwd+bwd")):
        floor = ("x * w (autograd floor) fwd+bwd",) if kind == "fwd+bwd" else ()
        for name in (f"torch_pallas.indrnn {kind}", f"torch_pallas.indrnn (old path) {kind}", peer, *floor):
            median, minimum = _stats(indrnn[name])
            is_peer = name in (peer, *floor)
            rows.append([name.rsplit(" ", 1)[0], kind, f"one call, {INDRNN_SHAPE}", median, minimum,
                         "—" if is_peer else peer.rsplit(" ", 1)[0],
                         None if is_peer else median / statistics.median(indrnn[peer])])

    gpt2 = host_round_robin(_gpt2_contenders(), warmup=2, rounds=gpt2_rounds)
    raw.update(gpt2)
    reference = statistics.median(gpt2["GPT-2 step, torch dropout"])
    for name, samples in gpt2.items():
        median, minimum = _stats(samples)
        is_peer = name == "GPT-2 step, torch dropout"
        rows.append([name, "fwd+loss+bwd", "graph building of one step", median, minimum,
                     "—" if is_peer else "GPT-2 step, torch dropout", None if is_peer else median / reference])

    load = f"At the start: {load_before}. At the end: {_machine_load()}."
    md = markdown_table(["contender", "pass", "measured", "median host ms", "min host ms", "peer",
                         "median / peer's median"], rows)
    md += (
        f"\nHost time to build the lazy graph (Python, torch's dispatch, torch_xla's tracing), not XLA's "
        f"compile or run: the clock stops before the graph is synced; each call is then run and one element "
        f"of each output fetched, untimed, so the next starts from an empty graph. Within each group "
        f"(chains, IndRNN, GPT-2) the contenders are timed round-robin in one process, {rounds} rounds "
        f"({gpt2_rounds} for GPT-2) after warm-up. Chains: {CHAIN} steps of `h = dropout(h, {P}) + 1` (or "
        f"`h = h + uniform(h.shape)` / `torch.rand`; the key draw, what every torch_pallas call without a "
        f"seed does first: `seeds.key_data()`, a `torch.randint` of two int32 words from the XLA RNG, "
        f"beside `h = h + 1`) on an {SHAPE} float32 tensor that requires grad; 'fwd+bwd' "
        f"adds `h.sum().backward()`; per call = median over rounds of (chain - the same round's chain of "
        f"`h = h + 1`) / {CHAIN}; min = (best chain - best baseline) / {CHAIN}. IndRNN: one call at (T, B, F) = "
        f"{INDRNN_SHAPE}, relu, against one `call_jax` of a jitted `lax.scan` (fwd) or of its `jax.grad` "
        "(fwd+bwd: one call computing forward and backward, outside torch's autograd); the autograd floor is "
        "`x * w` with `backward(g)` into the same two leaves, what any op pays for torch's autograd there. GPT-2: 6 layers, width 256, 4 heads, vocabulary "
        "8192, batch 8 x 128, eager attention, 19 dropouts of 0.1; forward, loss and `backward()` (no "
        "optimizer update); torch_pallas = `convert_dropout` + `route_dropout` (every dropout of this model is an `nn.Dropout`, so "
        "`convert_dropout` alone reaches them all too: that row shows what the routing mode, a Python "
        "`TorchFunctionMode` that sees every torch call of the step, costs); dropout off = the model in "
        "eval mode. 'old path' rows call the same kernels as before #19: through the custom op's dispatch "
        "and one `call_jax` per call, monkeypatched in for those rows only (the public functions' checks "
        "are today's). Targets of #19: "
        "torch_pallas.dropout fwd+bwd <= 1.0x F.dropout; GPT-2 step <= 1.05x torch dropout; indrnn fwd+bwd <= "
        f"one call_jax of scan. {load}\n")
    write("dispatch", {"mode": "full" if full else "quick", "rounds": rounds, "gpt2_rounds": gpt2_rounds,
                       "load": load, "rows": rows, "samples_ms": raw}, md, None)
    return md
