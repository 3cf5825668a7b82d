"""examples/train_torchax.py's training step compiled whole for the newest TPU the torchax
stack's libtpu knows (TPU7x, which torch_xla's libtpu does not), on CPU, never run: under
``tpu_compile.lowering_for_tpu()`` every torch_pallas op traced into the ``jax.jit`` step is a
Mosaic kernel, the hardware PRNG's included (``bench/bench_tpu_step.py`` compiles the
benchmark's models the same way)."""

import sys
from pathlib import Path

import jax
import pytest
import torch
import torchax
from torchax import interop

import torch_pallas
from torch_pallas import bridge, tpu_compile
from torch_pallas.kernels import attention as attention_kernels, dropout as dropout_kernels
from torch_pallas.tpu_compile import GENERATIONS

from conftest import NEEDS_LIBTPU, ON_TPU

pytest.importorskip("transformers", reason="the test extra installs transformers")
sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import train_torchax  # noqa: E402

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(ON_TPU, reason="on a TPU the kernels are Mosaic kernels anyway and the step runs for real"),
    NEEDS_LIBTPU,
]

NEWEST = list(GENERATIONS)[-1]


def test_newest_generation_is_tpu7x():
    """The torchax stack's pin is what brings TPU7x (README, What is verified where)."""
    assert NEWEST == "tpu7x"


def training_step():
    """The example's step (GPT-2, sdpa attention, every dropout routed) as a function of flat
    arrays, and their shapes."""
    env = torchax.default_env()
    torch.manual_seed(0)
    model = train_torchax.make_model().train()
    with env:
        model.to("jax")
        ids = interop.jax_view(next(train_torchax.batches(torch.Generator().manual_seed(0))).to("jax"))
        key_data = interop.jax_view(torch_pallas.seeds.key_data(seed=1))
    init, update = train_torchax.adam(1e-3)
    step, params, buffers = train_torchax.make_train_step(model, update)
    arrays, tree = jax.tree.flatten((params, buffers, init(params), ids, key_data))

    def flat_step(*arrays):
        return step(*jax.tree.unflatten(tree, arrays))

    return flat_step, [jax.ShapeDtypeStruct(array.shape, array.dtype) for array in arrays]


@pytest.mark.slow
def test_hardware_impl_training_step_compiles_whole_for_tpu7x(monkeypatch):
    step, shapes = training_step()
    kernels, jitted = [], bridge.jitted
    monkeypatch.setattr(bridge, "jitted", lambda f, static, interpret: kernels.append((f, interpret)) or jitted(
        f, static, interpret))
    with tpu_compile.lowering_for_tpu():  # inside: impl="hardware" is accepted off a TPU
        torch_pallas.random.set_default_impl("hardware")
        try:
            compiled = tpu_compile.compile_for_tpu(step, *shapes, generation=NEWEST)
        finally:
            torch_pallas.random.set_default_impl(None)
    layers = train_torchax.make_model().config.n_layer
    # Per layer the flash forward and backward and two residual dropouts forward and backward;
    # the embedding's dropout forward and backward: each lowered for TPU (Mosaic), none interpreted.
    assert [f for f, _ in kernels].count(dropout_kernels.dropout) == 2 * (1 + 2 * layers)
    assert [f for f, _ in kernels].count(attention_kernels.attention_backward) == layers
    assert not any(interpret for _, interpret in kernels)
    assert compiled.memory_analysis().peak_memory_in_bytes > 0
