"""A small training run with torch_pallas dropout on an XLA device.

A two-hidden-layer MLP with ``torch.nn.Dropout`` learns a noisy nonlinear regression on
synthetic data; ``torch_pallas.convert_dropout`` swaps its dropout layers for ones that keep
an 8-byte key per call instead of a mask. The step runs under
``torch.compile(backend="openxla")``; the script prints the loss falling and how many XLA
graphs were compiled. Runs on PJRT_DEVICE=CPU (the default) in a few seconds.

    ./dev example            # or: PJRT_DEVICE=TPU ./dev example on a TPU VM
"""

import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as metrics  # noqa: E402

import torch_pallas  # noqa: E402


def make_data(num_samples: int, features: int, generator: torch.Generator):
    """Targets from a random two-layer teacher network, plus a little noise."""
    x = torch.randn(num_samples, features, generator=generator)
    hidden = torch.tanh(x @ torch.randn(features, 32, generator=generator) / features**0.5)
    y = hidden @ torch.randn(32, 1, generator=generator) / 32**0.5
    return x, y + 0.05 * torch.randn(num_samples, 1, generator=generator)


def main(steps: int = 200, batch_size: int = 128, features: int = 64):
    device = torch_xla.device()
    torch.manual_seed(0)
    torch_xla.manual_seed(0)
    x, y = make_data(4096, features, torch.Generator().manual_seed(0))
    # One device tensor per batch, made once: slicing inside the loop would put each batch's
    # offset into the graph and compile a new one per batch.
    batches = [(inputs.to(device), targets.to(device))
               for inputs, targets in zip(x.split(batch_size), y.split(batch_size))]
    x, y = x.to(device), y.to(device)

    model = torch.nn.Sequential(
        torch.nn.Linear(features, 256), torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(256, 1),
    )
    model = torch_pallas.convert_dropout(model).to(device)
    print(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    forward = torch.compile(model, backend="openxla", fullgraph=True)

    start = time.perf_counter()
    for step in range(steps):
        inputs, targets = batches[step % len(batches)]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(inputs), targets)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d}  train loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        eval_loss = torch.nn.functional.mse_loss(model(x), y).item()
    print(f"eval loss (dropout off) {eval_loss:.4f}; {steps} steps in {elapsed:.1f} s; "
          f"XLA graphs compiled: {int(metrics.metric_data('CompileTime')[0])}")


if __name__ == "__main__":
    main()
