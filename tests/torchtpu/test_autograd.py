"""torch's autograd over torch_pallas ops on fake ``tpu`` tensors, run through compiled autograd
(:class:`~torchtpu_support.CompiledBackward`: the autograd engine's own execution crashes without
a TPU): each backward regenerates its noise from the forward's key, gradients reach every input
with its shape, ``checkpoint`` recomputes its region with the region's key, and a GPT-2 training
step (dynamo's forward graph, compiled autograd's backward graph) runs in torch_pallas ops."""

import collections

import pytest
import torch

import torch_pallas
from torchtpu_support import (CapturedGraphs, CompiledBackward, DispatchedOps, check_on_tpu, graph_targets,
                              torch_noise_ops, torch_pallas_ops)

SHAPE = (64, 256)


def _parameter(*shape):
    return torch.randn(*shape, device="tpu", requires_grad=True)


def test_dropout_backward_regenerates_the_mask_from_the_forward_key(fake):
    x = _parameter(*SHAPE)
    with DispatchedOps(record_args=True) as forward:
        y = torch_pallas.dropout(x, 0.25)
    (forward_args,) = [args for name, args in forward.calls if name == "torch_pallas::dropout"]
    with CompiledBackward() as backward:
        (y * y).sum().backward()
    (backward_args,) = backward.args_of("torch_pallas::dropout")
    assert backward_args[1] is forward_args[1] and backward_args[2:5] == (0.25, "tiled", False)  # the default impl
    assert not torch_noise_ops(backward.names), backward.names
    check_on_tpu(x.grad, SHAPE, torch.float32)


def test_autograd_grad_runs_too(fake):
    x = _parameter(*SHAPE)
    y = torch_pallas.dropout(x, 0.5, seed=3)
    with CompiledBackward() as backward:
        (grad,) = torch.autograd.grad(y.sum(), [x])
    assert backward.names.count("torch_pallas::dropout") == 1
    check_on_tpu(grad, SHAPE, torch.float32)


def test_attention_backward_gets_the_forward_key_and_returns_every_gradient(fake):
    query, key, value = (_parameter(2, 4, 128, 64) for _ in range(3))
    with DispatchedOps(record_args=True) as forward:
        out = torch_pallas.scaled_dot_product_attention(query, key, value, dropout_p=0.1, is_causal=True)
    (forward_args,) = [args for name, args in forward.calls if name == "torch_pallas::attention"]
    with CompiledBackward() as backward:
        out.square().sum().backward()
    (backward_args,) = backward.args_of("torch_pallas::attention_backward")
    assert any(arg is forward_args[4] for arg in backward_args), "the backward kernel gets the forward's key data"
    assert not torch_noise_ops(backward.names), backward.names
    for tensor in (query, key, value):
        check_on_tpu(tensor.grad, (2, 4, 128, 64), torch.float32)


def test_dropout_matmul_and_indrnn_backward_kernels_return_every_gradient(fake):
    weights, value = _parameter(2, 128, 128), _parameter(2, 128, 64)
    x, recurrent = _parameter(16, 4, 128), _parameter(128)
    fused = torch_pallas.dropout_matmul(weights, value, 0.1)
    output, h_n = torch_pallas.indrnn(x, recurrent)
    with CompiledBackward() as backward:
        (fused.sum() + output.sum() + h_n.sum()).backward()
    counts = collections.Counter(torch_pallas_ops(backward.names))
    assert counts == {"torch_pallas::dropout_matmul_backward": 1, "torch_pallas::indrnn_backward": 1}, counts
    for tensor, shape in ((weights, (2, 128, 128)), (value, (2, 128, 64)), (x, (16, 4, 128)), (recurrent, (128,))):
        check_on_tpu(tensor.grad, shape, torch.float32)


def test_checkpoint_recomputes_its_region_with_the_region_key(fake):
    """Non-reentrant checkpointing (the reentrant form runs a nested backward, which compiled
    autograd does not take over)."""
    linear = torch.nn.Linear(256, 256, device="tpu")
    x = _parameter(*SHAPE)
    with DispatchedOps(record_args=True) as forward:
        y = torch_pallas.checkpoint(lambda x: torch_pallas.dropout(linear(x), 0.1), x, use_reentrant=False)
    (forward_fold,) = [args for name, args in forward.calls if name == "torch_pallas::fold_in"]
    with CompiledBackward() as backward:
        y.sum().backward()
    ours = torch_pallas_ops(backward.names)
    assert ours == ["torch_pallas::fold_in", "torch_pallas::dropout", "torch_pallas::dropout"], ours
    (recomputed_fold,) = backward.args_of("torch_pallas::fold_in")
    assert recomputed_fold[0] is forward_fold[0] and recomputed_fold[1:] == forward_fold[1:]
    assert "aten::randint" not in backward.names  # no new key drawn
    check_on_tpu(x.grad, SHAPE, torch.float32)
    check_on_tpu(linear.weight.grad, (256, 256), torch.float32)


def test_a_gpt2_training_step_traces_whole_in_torch_pallas_ops(fake):
    """The forward and loss in one dynamo graph (``fullgraph=True``), the backward in one compiled
    autograd graph; every dropout routed, register_attention's attention."""
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    name = torch_pallas.register_attention()
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2, attn_pdrop=0.1,
                                     resid_pdrop=0.1, embd_pdrop=0.1, use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("tpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name).train()
    ids = torch.randint(3, 128, (2, 16), device="tpu")
    forward_graphs = CapturedGraphs()

    @torch.compile(backend=forward_graphs, fullgraph=True)
    def loss_of(ids):
        # The loss outside the model: transformers 5's loss_function logs a warning_once that
        # dynamo refuses to trace (a graph break in any compiled GPT-2, not ours).
        with torch_pallas.route_dropout():
            logits = model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    loss = loss_of(ids)
    (graph,) = forward_graphs
    targets = graph_targets(graph)
    assert targets["torch_pallas.dropout.default"] == 3 and targets["torch_pallas.attention.default"] == 1, targets
    assert not [target for target in targets if "bernoulli" in target or "dropout" in target.split(".")[0]]
    with CompiledBackward() as backward:
        loss.backward()
    assert len(backward.graphs) == 1
    counts = collections.Counter(torch_pallas_ops(backward.names))
    assert counts == {"torch_pallas::dropout": 3, "torch_pallas::attention_backward": 1}, counts
    assert not torch_noise_ops(backward.names), backward.names
    for parameter in model.parameters():
        check_on_tpu(parameter.grad, parameter.shape, torch.float32)
