"""examples/train_torchax.py: a transformers GPT-2 (sdpa attention, dropout 0.1) trained on
torchax under one jax.jit-compiled step with every dropout from torch_pallas; the same step
compiled for TPU7x."""

import sys
from pathlib import Path

import jax
import pytest
import torch
import torchax
from torchax import interop

import torch_pallas
from torch_pallas import tpu_compile
from torch_pallas.tpu_compile import GENERATIONS
from torch_pallas.kernels import attention as attention_kernels, dropout as dropout_kernels

pytest.importorskip("transformers", reason="the test extra installs transformers")
sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import train_torchax  # noqa: E402
from kernel_calls import record_kernels  # noqa: E402
from conftest import NEEDS_LIBTPU, ON_TPU  # noqa: E402

ENV = torchax.default_env()


def test_compiled_training_learns_and_traces_once():
    """docs/tour-torchax.md (train_torchax.py): the loss falls in 4 steps; new key data each step does not retrace."""
    losses, compiled = train_torchax.train(steps=4)
    assert compiled._cache_size() == 1
    assert losses[-1] < losses[0] - 0.3, losses


def example_step(route=True):
    """The example's training step (a JAX function) and its arguments."""
    torch.manual_seed(0)
    model = train_torchax.make_model().train()
    with ENV:
        model.to("jax")
        ids = interop.jax_view(next(train_torchax.batches(torch.Generator().manual_seed(0))).to("jax"))
        key_data = interop.jax_view(torch_pallas.seeds.key_data(seed=1))
    init, update = train_torchax.adam(1e-3)
    step, params, buffers = train_torchax.make_train_step(model, update, route=route)
    return step, (params, buffers, init(params), ids, key_data)


def step_jaxpr(route, monkeypatch):
    """The training step's jaxpr, and the kernels torch_pallas traced into it."""
    step, arguments = example_step(route)
    kernels = record_kernels(monkeypatch)
    # torchax's own dropout (route=False) rotates its RNG inside the trace and would leave a
    # tracer there for every later draw: trace with a key of its own, dropped afterwards.
    with ENV.override_property(prng=jax.random.key(0)):
        return str(jax.make_jaxpr(step)(*arguments)), [f for f, _ in kernels]


def test_every_dropout_and_the_attention_run_in_torch_pallas_kernels(monkeypatch):
    layers = train_torchax.make_model().config.n_layer
    torchs, none = step_jaxpr(False, monkeypatch)
    assert "random_bits" in torchs and none == []  # torchax's dropout draws with jax.random
    ours, kernels = step_jaxpr(True, monkeypatch)
    assert "random_bits" not in ours  # no dropout of torch's (torchax's) left
    # Flash attention forward and backward per layer (not torchax's reference attention); the
    # embedding's and each layer's two residual dropouts, forward and backward.
    assert kernels.count(attention_kernels.attention_forward) == layers
    assert kernels.count(attention_kernels.attention_backward) == layers
    assert kernels.count(dropout_kernels.dropout) == 2 * (1 + 2 * layers), kernels


@pytest.mark.tpu_compile
@NEEDS_LIBTPU
@pytest.mark.skipif(ON_TPU, reason="on a TPU the kernels are Mosaic kernels anyway and the step runs for real")
def test_hardware_impl_step_compiles_whole_for_tpu7x(monkeypatch):
    """The step compiled for TPU7x (which the torchax stack's libtpu knows and torch_xla's does
    not), never run: under lowering_for_tpu every kernel is lowered for TPU, the hardware PRNG's
    included (bench/bench_tpu_step.py compiles the benchmark's models the same way)."""
    assert "tpu7x" in GENERATIONS
    step, arguments = example_step()
    arrays, tree = jax.tree.flatten(arguments)
    kernels = record_kernels(monkeypatch)
    with tpu_compile.lowering_for_tpu():  # inside: impl="hardware" is accepted off a TPU
        torch_pallas.random.set_default_impl("hardware")
        try:
            compiled = tpu_compile.compile_for_tpu(lambda *arrays: step(*jax.tree.unflatten(tree, arrays)),
                                                   *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
                                                   generation="tpu7x")
        finally:
            torch_pallas.random.set_default_impl(None)
    layers = train_torchax.make_model().config.n_layer
    assert [f for f, _ in kernels].count(dropout_kernels.dropout) == 2 * (1 + 2 * layers)
    assert [f for f, _ in kernels].count(attention_kernels.attention_backward) == layers
    assert not any(interpret for _, interpret in kernels)
    assert compiled.memory_analysis().peak_memory_in_bytes > 0
