"""The time estimate of a whole torch training step (``compile_graph(..., estimate=True)``): a
GPT-2 step built under ``lowering_for_tpu``, with torch_pallas's dropout and with torch's."""

import contextlib

import pytest

torch_xla = pytest.importorskip("torch_xla", reason="compile_graph compiles torch_xla's lazy graphs (the xla stack)")
pytest.importorskip("transformers", reason="the test extra installs transformers: pip install -e '.[test]'")

import torch  # noqa: E402

import torch_pallas  # noqa: E402
from torch_pallas import tpu_compile  # noqa: E402

from conftest import NEEDS_LIBTPU, ON_TPU  # noqa: E402
from test_tpu_graph import gpt2  # noqa: E402

pytestmark = [pytest.mark.tpu_compile, NEEDS_LIBTPU,
              pytest.mark.skipif(ON_TPU, reason="on a TPU the step runs for real")]


@pytest.mark.parametrize("dropout, kernels", [("torch_pallas", 8), ("torch", 0)])
def test_a_gpt2_steps_estimate_covers_its_fusions_and_kernels(dropout, kernels):
    torch.manual_seed(0)
    model = gpt2().to(torch_xla.device()).train()
    ids = torch.randint(0, 128, (2, 16)).to(torch_xla.device())
    torch_xla.sync()
    routing = torch_pallas.route_dropout() if dropout == "torch_pallas" else contextlib.nullcontext()
    with tpu_compile.lowering_for_tpu(), routing:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    outputs = [loss, *(parameter.grad for parameter in model.parameters())]
    estimate = tpu_compile.compile_graph(outputs, "v5e", estimate=True).estimate
    # The CPU client cannot run this graph: keep no live tensor of it for a later sync.
    del outputs, loss
    model.zero_grad(set_to_none=True)
    assert estimate.generation == "v5e" and estimate.seconds > 0 and estimate.program_bundles > 0
    kinds = [op.kind for op in estimate.ops]
    # 4 dropouts (embedding; the layer's attention probabilities, attention and MLP outputs),
    # forward and backward kernels, among XLA's fusions.
    assert kinds.count("kernel") == kernels and "fusion" in kinds
    assert all(op.seconds > 0 for op in estimate.ops if op.kind == "kernel")
    assert estimate.seconds == pytest.approx(estimate.program_seconds + sum(op.seconds for op in estimate.ops))
