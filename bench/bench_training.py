"""Training steps: a model with dropout layers and one with an IndRNN, 20 steps each, in eager
(lazy tensor) mode and under torch.compile(backend="openxla"), against the same models built
from torch's own layers. Reports the median step time after warm-up and the XLA compiles
(all, and after warm-up: the target is none)."""

from __future__ import annotations

import statistics
import time

import torch
import torch_xla
import torch_xla.debug.metrics as metrics

import torch_pallas
from common import markdown_table, wait_for_xla, write

STEPS, WARMUP = 20, 3


def mlp(use_pallas: bool):
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(1024, 1))
    return torch_pallas.convert_dropout(model) if use_pallas else model


class TorchIndRNN(torch.nn.Module):
    """The same layer as torch_pallas.nn.IndRNN (one layer), written as a torch loop over time."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.projection = torch.nn.Linear(input_size, hidden_size)
        self.weight_hh = torch.nn.Parameter(torch.rand(hidden_size))

    def forward(self, x):
        h, outputs = x.new_zeros(x.shape[1], self.weight_hh.shape[0]), []
        for x_t in self.projection(x):
            h = torch.relu(x_t + self.weight_hh * h)
            outputs.append(h)
        return torch.stack(outputs), h


class SequenceModel(torch.nn.Module):
    def __init__(self, use_pallas: bool):
        super().__init__()
        self.rnn = torch_pallas.nn.IndRNN(32, 256) if use_pallas else TorchIndRNN(32, 256)
        self.dropout = (torch_pallas.nn.Dropout if use_pallas else torch.nn.Dropout)(0.1)
        self.readout = torch.nn.Linear(256, 1)

    def forward(self, x):
        output, _ = self.rnn(x)
        return self.readout(self.dropout(output[-1]))


def run_steps(model, inputs, target, compiled: bool):
    device = torch_xla.device()
    torch.manual_seed(0)
    model = model.to(device)
    inputs, target = inputs.to(device), target.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    forward = torch.compile(model, backend="openxla") if compiled else model
    compiles_before = metrics.metric_data("CompileTime")[0] if metrics.metric_data("CompileTime") else 0
    times, losses, compiles_at_warmup = [], [], None
    for step in range(STEPS):
        if step == WARMUP:
            compiles_at_warmup = metrics.metric_data("CompileTime")[0]
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(inputs), target)
        loss.backward()
        optimizer.step()
        wait_for_xla([loss, *model.parameters()])
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss)
    compiles_after = metrics.metric_data("CompileTime")[0]
    return {"median_step_ms": statistics.median(times[WARMUP:]), "first_step_ms": times[0],
            "compiles": int(compiles_after - compiles_before),
            "compiles_after_warmup": int(compiles_after - compiles_at_warmup),
            "final_loss": losses[-1].item()}


def run(full: bool):
    generator = torch.Generator().manual_seed(0)
    cases = {
        "MLP with 2 dropout layers (batch 256)": (mlp, torch.randn(256, 256, generator=generator),
                                                  torch.randn(256, 1, generator=generator)),
        "IndRNN (T=64, B=32, 256 units) + dropout": (SequenceModel, torch.randn(64, 32, 32, generator=generator),
                                                     torch.randn(32, 1, generator=generator)),
    }
    rows = []
    for case, (build, inputs, target) in cases.items():
        for use_pallas in (True, False):
            for compiled in (False, True):
                result = run_steps(build(use_pallas), inputs, target, compiled)
                rows.append({"model": case, "layers": "torch_pallas" if use_pallas else "torch",
                             "mode": "torch.compile(openxla)" if compiled else "eager (lazy)", **result})
    md = markdown_table(
        ["model", "layers", "mode", "median step ms", "first step ms", "XLA compiles", "compiles after warm-up"],
        [[r["model"], r["layers"], r["mode"], r["median_step_ms"], r["first_step_ms"], r["compiles"],
          r["compiles_after_warmup"]] for r in rows])
    md += (f"\n{STEPS} steps, the first {WARMUP} are warm-up. The torch IndRNN is the same layer as a Python "
           "loop over time (its lazy graph grows with T, so it compiles like an unrolled loop).\n")

    def plot(path):
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 3.5), squeeze=False)
        for axis, case in zip(axes[0], cases):
            selected = [r for r in rows if r["model"] == case]
            labels = [f"{r['layers']}\n{r['mode']}" for r in selected]
            axis.bar(range(len(selected)), [r["median_step_ms"] for r in selected])
            axis.set(xticks=range(len(selected)), xticklabels=labels, ylabel="median step ms", title=case)
            axis.tick_params(axis="x", labelsize=7)
        figure.tight_layout()
        figure.savefig(path, dpi=100)

    write("training", {"mode": "full" if full else "quick", "steps": STEPS, "warmup": WARMUP, "rows": rows}, md,
          plot)
    return md
