"""A whole torch training step compiled for TPU v4, v5e, v5p and v6e by libtpu, on CPU.

Under :func:`torch_pallas.tpu_compile.lowering_for_tpu` the bridge puts each kernel into the
lazy graph as a Mosaic TPU custom call; :func:`torch_pallas.tpu_compile.compile_graph`
compiles the graph torch_xla built (never run here). A GPT-2 step with every dropout routed
to torch_pallas compiles whole, and so does the same step with torch's dropout.
"""

import contextlib
import math
import re

import pytest
import torch
import torch_xla

import torch_pallas
from torch_pallas import bridge, tpu_compile
from torch_pallas.tpu_compile import GENERATIONS

from conftest import NEEDS_LIBTPU, ON_TPU, crossed
from hlo_dump import tpu_kernels

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers: pip install -e '.[test]'")

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(ON_TPU, reason="on a TPU the kernels are TPU custom calls anyway and the step runs for real"),
    NEEDS_LIBTPU,
]

# rng-bit-generator's outputs: (state, bits); the bits' element type and shape.
RNG_BITS = re.compile(r"rng-bit-generator\.\d+ = \(u64\[2\]\{0\}, \w+\[([\d,]*)\]")


def random_bits_drawn(hlo: str) -> list[int]:
    """The number of random words each rng-bit-generator in ``hlo`` draws."""
    return [math.prod(int(size) for size in shape.split(",") if size) for shape in RNG_BITS.findall(hlo)]


def kernel_graph():
    x = torch.ones(8, 128, device=torch_xla.device())
    return x, torch_pallas.dropout(x, 0.5, seed=1)


def test_lowering_for_tpu_is_off_by_default_and_leaves_normal_runs_alone():
    assert not bridge.lowers_for_tpu()
    assert not bridge._lowering_for_tpu_in({}) and not bridge._lowering_for_tpu_in({"TORCH_PALLAS_LOWER_FOR_TPU": "0"})
    assert bridge._lowering_for_tpu_in({"TORCH_PALLAS_LOWER_FOR_TPU": "1"})
    with pytest.raises(KeyError), tpu_compile.lowering_for_tpu():
        assert bridge.lowers_for_tpu()
        x, lowered = kernel_graph()
        raise KeyError  # the switch is restored on the way out
    assert not bridge.lowers_for_tpu()
    assert "tpu_custom_call" in torch_xla._XLAC._get_xla_tensors_hlo([lowered])
    with pytest.raises(RuntimeError, match="tpu_custom_call"):  # built, never run on the CPU client
        lowered.cpu()
    x, y = kernel_graph()
    assert "tpu_custom_call" not in torch_xla._XLAC._get_xla_tensors_hlo([y])
    kept = y.cpu() != 0
    assert 0.4 < kept.float().mean() < 0.6 and torch.equal(y.cpu()[kept], torch.full((int(kept.sum()),), 2.0))


def test_compile_graph_rejects_what_it_cannot_compile(monkeypatch):
    x, y = kernel_graph()
    with pytest.raises(ValueError, match="generation must be one of 'v4'.*got 'v7x'"):
        tpu_compile.compile_graph([y], "v7x")
    with pytest.raises(ValueError, match="XLA tensors"):
        tpu_compile.compile_graph([y.cpu()], "v5e")
    monkeypatch.setattr(tpu_compile, "available", lambda: False)
    with pytest.raises(RuntimeError, match="needs libtpu"):
        tpu_compile.compile_graph([y], "v5e")


def gpt2():
    # Eager attention: its dropout is an nn.Dropout that route_dropout reaches (SDPA's is not).
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2, attn_pdrop=0.1,
                                     resid_pdrop=0.1, embd_pdrop=0.1, use_cache=False, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


class Step:
    """One step's graph outputs and HLO. Its repr shows no tensor: printing one (pytest's
    report of a failing test's arguments) would run the TPU-only graph on the CPU client,
    which aborted the process."""

    def __init__(self, outputs, hlo):
        self.outputs, self.hlo = outputs, hlo

    def __repr__(self):
        return f"Step({len(self.outputs)} outputs)"


@pytest.fixture(scope="module")
def training_steps():
    """The graphs of one GPT-2 training step (loss and every gradient), built under the
    switch with torch_pallas's dropout and with torch's, and their HLO text."""
    torch.manual_seed(0)
    model = gpt2().to(torch_xla.device()).train()
    ids = torch.randint(0, 128, (2, 16)).to(torch_xla.device())
    steps = {}
    for name in ("torch_pallas", "torch"):
        model.zero_grad(set_to_none=True)
        routing = torch_pallas.route_dropout() if name == "torch_pallas" else contextlib.nullcontext()
        with tpu_compile.lowering_for_tpu(), routing:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        outputs = [loss, *(parameter.grad for parameter in model.parameters())]
        steps[name] = Step(outputs, torch_xla._XLAC._get_xla_tensors_hlo(outputs))
    # The CPU client cannot run these graphs: keep no live tensor of them for a later sync.
    model.zero_grad(set_to_none=True)
    yield steps
    steps.clear()


def test_the_routed_step_holds_the_kernels_as_tpu_custom_calls_and_draws_keys_only(training_steps):
    hlo = training_steps["torch_pallas"].hlo
    # 4 dropouts (embedding; the layer's attention probabilities, attention and MLP outputs),
    # forward and backward kernels (fused with what reads them: test_gpt2_training_step_compiles_whole_for_tpu).
    assert hlo.count('custom_call_target="tpu_custom_call"') == 8
    # The only random bits drawn are the dropouts' 2-word keys; torch's dropout draws a mask's worth each.
    assert random_bits_drawn(hlo) and max(random_bits_drawn(hlo)) == 2
    torch_bits = random_bits_drawn(training_steps["torch"].hlo)
    assert "tpu_custom_call" not in training_steps["torch"].hlo and max(torch_bits) == 2 * 2 * 16 * 16


# The newest generation; the others in the slow tier, as every kernel of the step is compiled for
# each generation in tests/kernels/test_tpu_compile.py.
@pytest.mark.parametrize("dropout,generation", crossed(
    {(dropout, list(GENERATIONS)[-1]) for dropout in ("torch_pallas", "torch")},
    dropout=["torch_pallas", "torch"], generation=list(GENERATIONS)))
def test_gpt2_training_step_compiles_whole_for_tpu(training_steps, dropout, generation, tmp_path):
    outputs = training_steps[dropout].outputs
    compiled = tpu_compile.compile_graph(outputs, generation, dump_to=tmp_path)
    assert compiled.generation == generation and compiled.seconds > 0
    # The compiled program names its kernels and counts their estimates: the 4 dropouts' forward
    # and backward kernels, of 2 x 16 x 32 or 2 x 2 x 16 x 16 = 1024 elements.
    [program] = tmp_path.glob("*after_optimizations.txt")
    kernels = tpu_kernels(program.read_text())
    # route_dropout()'s defaults: the embedding dropout, forward and backward; the attention and MLP
    # residual dropouts fused into their adds (their gradients: dropout kernels); the attention in the
    # flash kernels (short planes, two per grid step: one backward kernel gives every gradient). The
    # default impl, tiled, draws a 1024-element view as one (8, 1024) tile: one block of it.
    expected = (["dropout_tiled_b8x1024"] * 4 + ["dropout_add_tiled_b8x1024"] * 2
                + ["attention_fwd_tiled_p2_b16x16", "attention_dqkv_tiled_p2_b16x16"])
    assert sorted(name for name, _ in kernels) == (sorted(expected) if dropout == "torch_pallas" else [])
    assert all(cost["bytes_accessed"] == 2 * 4 * 1024 + 8 for name, cost in kernels if name.startswith("dropout_tiled"))
    # Every parameter's gradient and the loss are outputs (float32).
    parameter_bytes = sum(4 * output.numel() for output in outputs[1:])
    assert parameter_bytes <= compiled.output_bytes < 2 * parameter_bytes
    assert compiled.peak_bytes >= compiled.argument_bytes > 0 and compiled.temp_bytes >= 0
    assert compiled.flops > 0 and compiled.bytes_accessed > 0


def test_hardware_impl_is_accepted_when_lowering_for_tpu_and_compiles():
    x = torch.ones(256, 1024, device=torch_xla.device())
    if not ON_TPU:
        with pytest.raises(ValueError, match="needs PJRT_DEVICE=TPU"):
            torch_pallas.dropout(x, 0.5, impl="hardware")
    with tpu_compile.lowering_for_tpu():
        y = torch_pallas.dropout(x, 0.5, seed=1, impl="hardware")
    assert "tpu_custom_call" in torch_xla._XLAC._get_xla_tensors_hlo([y])
    assert tpu_compile.compile_graph([y], "v5e").peak_bytes > 0


def test_compile_graph_dumps_the_buffer_assignment_where_asked(tmp_path):
    x = torch.ones(256, 1024, device=torch_xla.device())
    with tpu_compile.lowering_for_tpu():
        y = torch_pallas.dropout(x, 0.5, seed=1)
    tpu_compile.compile_graph([y], "v5e", dump_to=tmp_path)
    [assignment] = tmp_path.glob("*after_optimizations-buffer-assignment.txt")
    # The kernel's output, as the compiler placed it: its shape with the layout's tiles.
    assert re.search(r"f32\[256,1024\]\{1,0:T\(8,128\)", assignment.read_text())
