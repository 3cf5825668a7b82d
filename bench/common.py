"""Timing and reporting shared by the benchmarks.

Every measurement excludes warm-up calls, reports the median of repeated runs, and reports
XLA compile time (torch_xla's CompileTime metric) separately from run time. A run is
wall-clock time from the call until the results exist on the device (:func:`wait_for_xla`;
``block_until_ready`` for JAX), so lazy-tensor tracing is included: it is part of what an
eager-mode user pays.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    repeats: int
    compile_s: float = 0.0      # XLA compile time during warm-up (torch_xla metric), or JAX lower+compile
    compiles: int = 0           # XLA compiles during warm-up
    compiles_after_warmup: int = 0

    def as_dict(self):
        return asdict(self)


def _compile_metric():
    import torch_xla.debug.metrics as metrics

    data = metrics.metric_data("CompileTime")
    return (0, 0.0) if data is None else (int(data[0]), float(data[1]) / 1e9)


def result_probe(outputs):
    """One scalar in the pending lazy graph that holds an element of every non-empty tensor in
    ``outputs`` (a tensor, or a tuple or list of them), or ``None`` when there is none: fetching
    it waits for the run that computes them (see :func:`wait_for_xla`).

    The element is taken by slicing every dimension, not as ``t.reshape(-1)[:1]``: torch_xla
    makes the flattened view a graph output of its own, which XLA must copy into a fresh
    full-size buffer (an extra pass over the tensor and, on the CPU client, a page fault per
    4 KiB of it on every run). Sliced in place, the views it keeps are at most ``t[:1]``.
    The elements are added into one scalar and fetched once: fetching an element of an
    SPMD-sharded tensor itself runs a program that replicates it (~26 ms each on 4 CPU
    devices, which the sharded rows once counted as dropout time).
    """
    import torch

    tensors = [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
               if isinstance(t, torch.Tensor) and t.numel()]
    probes = [t[(slice(0, 1),) * t.dim()].float().sum() for t in tensors]
    return sum(probes[1:], probes[0]) if probes else None


def wait_for_xla(outputs=()) -> None:
    """Runs the pending lazy graph and returns once ``outputs`` exist on the device.

    Neither ``torch_xla.sync(wait=True)`` nor ``xm.wait_device_ops()`` reliably waited for
    execution on the CPU client (a dropout timed at 4 ms that takes 25 ms in JAX directly),
    so one element of every output is put in the same graph (:func:`result_probe`), and
    fetched: a buffer cannot be read before it has been computed. The fetch costs a few bytes.
    """
    import torch_xla

    total = result_probe(outputs)
    if total is not None:
        torch_xla.sync()
        total.cpu()
    else:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()


def time_xla(fn, *, warmup: int = 2, repeats: int = 10) -> Timing:
    """Times ``fn`` (which returns the tensors it computes) on the XLA device."""
    return time_round_robin({"": Contender.xla(fn)}, warmup=warmup, repeats=repeats)[""]


def time_host(fn, *, warmup: int = 2, repeats: int = 10) -> Timing:
    """Times a synchronous host function (torch eager on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return Timing(statistics.median(samples), min(samples), repeats)


def time_jax(fn, *args, warmup: int = 2, repeats: int = 10) -> Timing:
    """Times a jitted JAX function; its first call (trace + compile) is reported as compile time."""
    return time_round_robin({"": Contender.jax(fn, *args)}, warmup=warmup, repeats=repeats)[""]


class Contender:
    """One implementation for :func:`time_round_robin`: ``Contender.xla(fn)`` for a function
    returning the tensors it computes on the XLA device, ``Contender.jax(fn, *args)`` for a
    jitted JAX function."""

    def __init__(self, run, on_xla: bool):
        self.run, self.on_xla = run, on_xla

    @classmethod
    def xla(cls, fn):
        return cls(lambda: wait_for_xla(fn()), on_xla=True)

    @classmethod
    def jax(cls, fn, *args):
        import jax

        return cls(lambda: jax.block_until_ready(fn(*args)), on_xla=False)


def time_round_robin(contenders: dict, *, warmup: int = 2, repeats: int = 10) -> dict:
    """Times several implementations of one computation in rounds, each round running every
    contender once, so that a slow phase of the machine (this VM's speed moves by 1.5x over
    minutes) falls on all of them alike rather than on whichever was being timed in it.

    Returns a :class:`Timing` per name. Compile time is torch_xla's CompileTime metric over an
    XLA contender's warm-up calls, and a JAX contender's first call less its median.
    """
    compiled, first_call = {}, {}
    for name, contender in contenders.items():
        count0, seconds0 = _compile_metric()
        start = time.perf_counter()
        contender.run()
        first_call[name] = time.perf_counter() - start
        for _ in range(warmup - 1):
            contender.run()
        count1, seconds1 = _compile_metric()
        compiled[name] = (count1 - count0, seconds1 - seconds0)
    samples = {name: [] for name in contenders}
    compiles_after = dict.fromkeys(contenders, 0)
    for _ in range(repeats):
        for name, contender in contenders.items():
            count0, _ = _compile_metric()
            start = time.perf_counter()
            contender.run()
            samples[name].append((time.perf_counter() - start) * 1e3)
            compiles_after[name] += _compile_metric()[0] - count0
    timings = {}
    for name, contender in contenders.items():
        median = statistics.median(samples[name])
        count, seconds = compiled[name] if contender.on_xla else (1, max(first_call[name] - median / 1e3, 0.0))
        timings[name] = Timing(median, min(samples[name]), repeats, seconds, count, compiles_after[name])
    return timings


def commit() -> str:
    """The checkout's commit, short, or "" outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def machine() -> dict:
    import jax
    import torch
    try:
        import torch_xla
        torch_xla_version = torch_xla.__version__
    except ImportError:  # the torchax stack's environment (a benchmark of its newer libtpu)
        torch_xla_version = "not installed"

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return {
        "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
        "pjrt_device": os.environ.get("PJRT_DEVICE"), "torch": torch.__version__,
        "torch_xla": torch_xla_version, "jax": jax.__version__, "commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": "not measured: no accelerator was lent to the session that produced these results",
        "allocator": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")) or "default",
    }


def ratio(value, reference):
    return None if value is None or not reference else value / reference


def write(name: str, payload: dict, table_md: str, plot, machine_info: dict | None = None) -> None:
    """Writes results/<name>.json (raw), .md (table) and .png (``plot(path)``); the header names
    ``machine_info`` (default: this process's :func:`machine`)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info or machine(), **payload}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=1, default=lambda o: o.as_dict()))
    header = (f"<!-- generated by bench/run.py; do not edit -->\n\nMachine: {payload['machine']['cpu']}, "
              f"{payload['machine']['cores']} cores, PJRT_DEVICE={payload['machine']['pjrt_device']}; "
              f"torch {payload['machine']['torch']}, torch_xla {payload['machine']['torch_xla']}, "
              f"jax {payload['machine']['jax']}; mode: {payload.get('mode')}; {payload['machine']['date']}. "
              f"GPU: {payload['machine']['gpu']}. glibc malloc: {payload['machine']['allocator']} (set by `./dev bench`). "
              f"Every row of this file was measured in one process, one after another unless the notes "
              f"below the table say otherwise.\n\n")
    (RESULTS / f"{name}.md").write_text(header + table_md)
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        plot(RESULTS / f"{name}.png")


def merged_rows(earlier: list, records: list, key) -> list:
    """``records`` over a results file's ``earlier`` rows: a run replaces only the rows with its
    records' ``key(row)`` and keeps the others."""
    new = {key(r) for r in records}
    return [r for r in earlier if key(r) not in new] + records


def markdown_table(headers, rows) -> str:
    def cell(value):
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.3g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def mask_noise_floor_seconds(generation: str, elements: int) -> float:
    """The least time one TPU device of ``generation`` takes to draw a dropout mask of
    ``elements`` elements with the default noise (``tiled``: ``prng.noise_ops`` integer ops an
    element, its 13-round hash shared by four 16-bit uniforms) at every vector-ALU slot
    (``tpu_schedule.valu_seconds``): the floor of the mask's vector work, as bytes over
    bandwidth is of its memory traffic."""
    from torch_pallas.kernels import prng, tiling
    from torch_pallas.tpu_schedule import valu_seconds

    vreg_ops = elements / (tiling.SUBLANES * tiling.LANES) * prng.noise_ops(prng.DROPOUT_DEFAULT, prng.DROPOUT_BITS)
    return valu_seconds(generation, vreg_ops)
