"""torch.compile's graph capture (dynamo) of torch_pallas ops on fake tpu tensors: the op in the
graph, no graph break, one graph for every key. TorchTPU's own backend is not run here: it
traces the backward with torch's autograd engine, which crashes on tpu tensors without a TPU
(SIGSEGV in GraphTask::exec_post_processing)."""

import torch
from torch._subclasses import FakeTensorMode

import torch_pallas
from torchtpu_support import CapturedGraphs, graph_targets


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(128, 128, device="tpu")

    def forward(self, x, seed=None):
        return torch_pallas.dropout(self.linear(x), 0.1, seed=seed).sum()


def _captured(function, *calls):
    """The graphs dynamo captures (``fullgraph=True``: a graph break raises) over ``calls``."""
    graphs = CapturedGraphs()
    compiled = torch.compile(function, backend=graphs, fullgraph=True)
    for args in calls:
        compiled(*args)
    return graphs


def test_a_block_compiles_whole_with_torch_pallas_dropout_in_the_graph():
    with FakeTensorMode():
        block, x = _Block(), torch.randn(8, 128, device="tpu")
        (graph,) = _captured(block, (x, 1))
    targets = graph_targets(graph)
    assert "torch_pallas.dropout.default" in targets, targets
    assert not [target for target in targets if "bernoulli" in target or "aten.dropout" in target]


def test_a_new_key_each_step_does_not_recompile():
    """Without a seed each call draws its key from the tpu generator inside the graph."""
    with FakeTensorMode():
        block, x = _Block(), torch.randn(8, 128, device="tpu")
        graphs = _captured(block, (x,), (x,), (x,))
    assert len(graphs) == 1
    targets = graph_targets(graphs[0])
    assert "torch_pallas.dropout.default" in targets and any("randint" in target for target in targets), targets
