"""The python blocks on TorchTPU's ``tpu`` device (the README's, the TorchTPU tour) run as
written, on fake ``tpu`` tensors: torch's autograd through compiled autograd (:class:`~torchtpu_support.CompiledBackward`),
``torch.compile``'s graphs captured instead of handed to TorchTPU's backend (which needs a TPU)."""

import collections
import importlib.util
from pathlib import Path

import torch

from torchtpu_support import (CapturedGraphs, CompiledBackward, check_on_tpu, graph_targets, torch_noise_ops,
                              torch_pallas_ops)

# tests/test_readme.py finds and classifies the blocks (a file of the xla stack's tests, which
# this stack does not collect: loaded by path).
_spec = importlib.util.spec_from_file_location("readme_snippets", Path(__file__).parents[1] / "test_readme.py")
snippets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(snippets)
TOUR = snippets.ROOT / "docs" / "tour-torchtpu.md"


def test_the_readme_and_the_tour_show_tpu_code():
    assert snippets.documents_with_blocks("torchtpu") == [snippets.README, TOUR]


def test_the_readmes_block_runs(fake):
    with CompiledBackward() as ran:
        namespace = snippets.run_blocks(snippets.README, "torchtpu")
    check_on_tpu(namespace["x"].grad, (64, 1024), torch.float32)
    assert ran.names.count("torch_pallas::dropout") == 1


def test_the_tour_runs(fake, monkeypatch):
    graphs = CapturedGraphs()
    compile = torch.compile

    def compile_capturing(model=None, **options):
        options.setdefault("backend", graphs)  # torch.compile(None, ...) calls itself again with it
        return compile(model, **options)

    monkeypatch.setattr(torch, "compile", compile_capturing)
    with CompiledBackward() as ran:
        namespace = snippets.run_blocks(TOUR, "torchtpu")
    check_on_tpu(namespace["x"].grad, (64, 1024), torch.float32)
    check_on_tpu(namespace["y7"], (64, 1024), torch.float32)
    check_on_tpu(namespace["output"], (100, 8, 256), torch.float32)
    check_on_tpu(namespace["u"], (1024, 1024), torch.float32)
    for parameter in namespace["gpt2"].parameters():
        check_on_tpu(parameter.grad, parameter.shape, torch.float32)
    (graph,) = graphs
    targets = graph_targets(graph)
    assert targets["torch_pallas.attention.default"] == 2 and targets["torch_pallas.dropout.default"] == 5, targets
    # The backward passes: x's dropout, then GPT-2's five dropouts and two attentions.
    ours = collections.Counter(torch_pallas_ops(ran.names))
    assert ours == {"torch_pallas::dropout": 1 + 5, "torch_pallas::attention_backward": 2}, ours
    assert not torch_noise_ops(ran.names), ran.names
