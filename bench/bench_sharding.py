"""Sharded (SPMD) tensors on 4 CPU devices: torch_pallas.dropout and torch_pallas.indrnn on a
tensor split over the devices, against the same call on the unsharded tensor and against
torch's ``F.dropout`` on the same sharded tensor. Forward+backward time, and the bytes of the
activation each device holds (its shard, read from the device buffers).

SPMD mode is process-wide, so :func:`run` measures in a process of its own
(``CPU_NUM_DEVICES=4``). The 4 "devices" share this machine's 2 cores: the times compare
the programs, not a multi-chip speed-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common import markdown_table, ratio, write

P = 0.1


def _worker(full: bool) -> list[dict]:
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    import torch_pallas
    from common import time_xla

    device = torch_xla.device()
    mesh = xs.Mesh(np.arange(4), (4, 1), ("data", "model"))
    repeats = 15 if full else 7

    def on_device(values, spec):
        tensor = values.to(device)
        if spec is not None:
            xs.mark_sharding(tensor, mesh, spec)
        return tensor.requires_grad_(True)

    def shard_bytes(tensor):
        shards = torch_xla._XLAC._get_local_shards([tensor])[0]
        return max(shard.numel() * shard.element_size() for shard, _ in shards)

    def dropout_step(dropout):
        def step(x):
            y = dropout(x)
            (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
            return y, grad
        return step

    def indrnn_step(x, weight):
        output, _ = torch_pallas.indrnn(x, weight)
        grad_x, grad_w = torch.autograd.grad(output, (x, weight), torch.ones_like(output))
        return output, grad_x, grad_w

    rows = []
    sizes = [2**20, 2**22] if full else [2**20]
    for size in sizes:
        values = torch.randn(size // 1024, 1024)
        for name, dropout, spec in [
                ("torch_pallas.dropout", lambda x: torch_pallas.dropout(x, P), ("data", None)),
                ("torch_pallas.dropout", lambda x: torch_pallas.dropout(x, P), None),
                ("torch F.dropout", lambda x: torch.nn.functional.dropout(x, P), ("data", None))]:
            x = on_device(values, spec)
            timing = time_xla(lambda: dropout_step(dropout)(x), repeats=repeats)
            rows.append({"op": "dropout fwd+bwd", "shape": list(values.shape), "impl": name,
                         "sharding": "4x1 (rows)" if spec else "unsharded", "timing": timing.as_dict(),
                         "bytes_per_device": shard_bytes(x)})
    T, B, F = (512, 64, 512) if full else (256, 64, 512)
    values, weight = torch.randn(T, B, F), (torch.rand(F) * 1.8 - 0.9)
    for spec in [(None, "data", None), None]:
        x, w = on_device(values, spec), weight.to(device).requires_grad_(True)
        timing = time_xla(lambda: indrnn_step(x, w), repeats=repeats)
        rows.append({"op": "indrnn fwd+bwd", "shape": [T, B, F], "impl": "torch_pallas.indrnn",
                     "sharding": "4x1 (batch)" if spec else "unsharded", "timing": timing.as_dict(),
                     "bytes_per_device": shard_bytes(x)})
    return rows


def run(full: bool):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    result = subprocess.run([sys.executable, __file__, "--worker"] + (["--full"] if full else []),
                            env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"the SPMD benchmark process failed:\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    unsharded = {(r["op"], tuple(r["shape"])): r["timing"]["median_ms"] for r in rows
                 if r["sharding"] == "unsharded" and r["impl"].startswith("torch_pallas")}
    table = markdown_table(
        ["op", "shape", "impl", "sharding", "median ms", "min ms", "x unsharded torch_pallas", "MiB per device"],
        [[r["op"], "x".join(map(str, r["shape"])), r["impl"], r["sharding"], r["timing"]["median_ms"],
          r["timing"]["min_ms"], ratio(r["timing"]["median_ms"], unsharded[(r["op"], tuple(r["shape"]))]),
          r["bytes_per_device"] / 2**20] for r in rows])
    note = ("\n4 CPU devices (`CPU_NUM_DEVICES=4`) sharing 2 cores: the times compare programs, not a "
            "multi-chip speed-up. MiB per device: the largest shard of the input held by one device.\n")
    write("sharding", {"mode": "full" if full else "quick", "rows": rows}, table + note, None)
    return table


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(_worker("--full" in sys.argv)))
