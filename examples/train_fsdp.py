"""torch_pallas dropout and IndRNN inside a model trained with torch_xla's SPMD FSDPv2.

The model (a projection with ``torch.nn.Dropout``, converted by ``torch_pallas.convert_dropout``,
then a two-layer ``torch_pallas.nn.IndRNN`` with dropout between layers, then a classifier) is
wrapped unchanged in ``SpmdFullyShardedDataParallel``: its parameters are sharded over the
mesh's ``fsdp`` axis and each batch is split over it. ``convert_dropout`` and the IndRNN are
given the activations' ``partition_spec``, so every dropout and recurrence kernel runs on
each device's shard of the batch, under ``torch.compile`` too. The script trains it compiled (``backend="openxla"``) and eagerly,
and prints the loss next to that of the same model trained unsharded with the same seeds
(every device holding the whole batch and every parameter), and the XLA compiles after warm-up.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv/bin/python examples/train_fsdp.py
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as metrics  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel  # noqa: E402

xr.use_spmd()

import torch_pallas  # noqa: E402


# This example's activations are small: a device's shard, 4 x 16 x 128, is less than one band of
# the tiled impl's tiles (the default, which splits in whole bands: docs/sharding.md). Threefry,
# drawn per element, takes any split.
IMPL = "threefry"


class SequenceClassifier(torch.nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, batch_split: dict):
        super().__init__()
        self.project = torch.nn.Linear(features, hidden)
        self.dropout = torch.nn.Dropout(0.2)
        self.rnn = torch_pallas.nn.IndRNN(hidden, hidden, num_layers=2, nonlinearity="tanh", dropout=0.1,
                                         batch_first=True, impl=IMPL, **batch_split)
        self.classify = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        output, _ = self.rnn(self.dropout(torch.relu(self.project(x))))
        return self.classify(output[:, -1])


def make_data(batches: int, batch_size: int, steps: int, features: int, classes: int):
    """Sequences whose class is which of ``classes`` directions their mean points to."""
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(classes, features, generator=generator)
    labels = torch.randint(classes, (batches, batch_size), generator=generator)
    x = directions[labels][:, :, None, :] + 2 * torch.randn(batches, batch_size, steps, features, generator=generator)
    return x, labels


def train(*, sharded: bool, compiled: bool = True, num_steps: int = 12, warm_up: int = 3, batch_size: int = 16,
          seq_len: int = 16, features: int = 64, hidden: int = 128, classes: int = 4):
    """Trains the model for ``num_steps``: wrapped in FSDPv2 with its batches split over the
    mesh if ``sharded``, else replicated on every device. Returns (losses, XLA compiles after
    ``warm_up`` steps)."""
    device = torch_xla.device()
    # Dynamo's guards do not look at shardings: a graph compiled for the sharded parameters
    # would be reused for unsharded ones (and fail on their buffer sizes).
    torch._dynamo.reset()
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (xr.global_runtime_device_count(), 1),
                   ("fsdp", "model"))
    # The activations are (batch, time, features), the batch split over the mesh's fsdp axis as
    # FSDPv2 splits it: the dropout and IndRNN kernels run on each device's shard.
    batch_split = dict(mesh=mesh, partition_spec=("fsdp", None, None)) if sharded else {}
    torch.manual_seed(0)
    model = torch_pallas.convert_dropout(SequenceClassifier(features, hidden, classes, batch_split), impl=IMPL,
                                         **batch_split)
    model = model.to(device)
    if sharded:
        model = SpmdFullyShardedDataParallel(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    # The wrapper's own forward marks its output with xs.mark_sharding, which dynamo cannot
    # trace in torch_xla 2.9 ("'XLAShardedTensor' object has no attribute '_local_tensor'"):
    # the wrapped module, whose parameters the wrapper has sharded, is what gets compiled.
    forward = model.module if sharded else model
    if compiled:
        forward = torch.compile(forward, backend="openxla")
    x, labels = make_data(4, batch_size, seq_len, features, classes)
    batches = []
    for inputs, targets in zip(x, labels):
        inputs, targets = inputs.to(device), targets.to(device)
        # Unsharded, the batches are marked replicated: torch_xla 2.9's dynamo bridge retraces
        # a compiled graph on every call whose unmarked input differs in sharding from the one
        # it traced (which it marked replicated), and the retrace's sync advances the RNG.
        batch_axis = "fsdp" if sharded else None
        xs.mark_sharding(inputs, mesh, (batch_axis, None, None))
        xs.mark_sharding(targets, mesh, (batch_axis,))
        batches.append((inputs, targets))

    losses, compiles_after_warm_up = [], 0
    for step in range(num_steps):
        if step == warm_up:
            compiles_after_warm_up = -metrics.metric_data("CompileTime")[0]
        # The step's dropout keys come from the XLA RNG: seeding it per step makes them the
        # same in both runs whatever else advanced it (the seed is data: nothing recompiles).
        torch_xla.manual_seed(step)
        inputs, targets = batches[step % len(batches)]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(inputs), targets)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item())
    compiles_after_warm_up += metrics.metric_data("CompileTime")[0]
    return losses, int(compiles_after_warm_up)


def main():
    for name, compiled in {"compiled": True, "eager": False}.items():
        sharded_losses, compiles = train(sharded=True, compiled=compiled)
        unsharded_losses, _ = train(sharded=False, compiled=compiled)
        print(f"{name}:")
        for step, (a, b) in enumerate(zip(sharded_losses, unsharded_losses)):
            print(f"  step {step:3d}  loss FSDPv2 {a:.6f}  unsharded {b:.6f}")
        print(f"  XLA compiles after warm-up (FSDPv2): {compiles}; "
              f"largest loss difference: {max(abs(a - b) for a, b in zip(sharded_losses, unsharded_losses)):.2e}")


if __name__ == "__main__":
    main()
