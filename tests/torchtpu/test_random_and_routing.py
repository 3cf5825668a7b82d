"""torch_pallas.random, route_dropout, checkpoint and register_attention on fake ``tpu`` tensors:
the samplers' kernel through TorchTPU's jax_op, torch's dropout and SDPA routed, a GPT-2 built on
the ``tpu`` device running its forward in torch_pallas ops."""

import collections

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from torchtpu_support import (DispatchedOps, check_dispatches, check_kernel_op, check_on_tpu, torch_noise_ops,
                              torch_pallas_ops)
from torch_pallas.ops import sampling

SHAPE = (8, 128)
SAMPLERS = {
    "uniform": (lambda **keys: torch_pallas.random.uniform(SHAPE, device="tpu", **keys), torch.float32),
    "normal": (lambda **keys: torch_pallas.random.normal(SHAPE, device="tpu", dtype=torch.bfloat16, **keys),
               torch.bfloat16),
    "bernoulli": (lambda **keys: torch_pallas.random.bernoulli(SHAPE, 0.3, device="tpu", **keys), torch.bool),
}


@pytest.mark.parametrize("name", SAMPLERS)
def test_samplers_dispatch_torch_pallas_sample_on_the_tpu_device(fake, name):
    sampler, dtype = SAMPLERS[name]
    for keys in (dict(seed=1), {}):
        check_on_tpu(check_dispatches(lambda: sampler(**keys), "torch_pallas::sample"), SHAPE, dtype)


def test_the_sampling_kernel_reaches_torchtpu_as_a_jax_op(fake):
    key_data = torch_pallas.seeds.key_data(seed=3, device="tpu")
    check_kernel_op(sampling._compute_sample, (key_data, SHAPE, "normal", torch.bfloat16, 0.5, "threefry"), "sample",
                    [(SHAPE, torch.bfloat16)])


def test_route_dropout_routes_torch_dropout_and_attention_with_dropout(fake):
    x, query = torch.randn(SHAPE, device="tpu"), torch.randn(2, 4, 128, 64, device="tpu")
    with DispatchedOps() as dispatched, torch_pallas.route_dropout():
        dropped = F.dropout(x, 0.1)
        module_dropped = torch.nn.Dropout2d(0.1)(query)
        attended = F.scaled_dot_product_attention(query, query, query, dropout_p=0.1)
    assert collections.Counter(torch_pallas_ops(dispatched.names)) == {
        "torch_pallas::dropout": 2, "torch_pallas::attention": 1}
    assert not torch_noise_ops(dispatched.names), dispatched.names
    check_on_tpu(dropped, SHAPE, torch.float32)
    check_on_tpu(module_dropped, query.shape, torch.float32)
    check_on_tpu(attended, query.shape, torch.float32)


def test_checkpoint_forward_draws_its_region_key_and_folds_it_in(fake):
    """Forward only: the recomputation runs in the backward pass, which torch's autograd engine
    runs (it crashes on tpu tensors without a TPU)."""
    linear = torch.nn.Linear(128, 128, device="tpu")
    x = torch.randn(SHAPE, device="tpu", requires_grad=True)
    with DispatchedOps() as dispatched:
        y = torch_pallas.checkpoint(lambda x: torch_pallas.dropout(linear(x), 0.1), x)
    ours = torch_pallas_ops(dispatched.names)
    assert ours == ["torch_pallas::fold_in", "torch_pallas::dropout"], dispatched.names
    assert "aten::randint" in dispatched.names  # the region's key, from the tpu generator
    check_on_tpu(y, SHAPE, torch.float32)
    assert y.requires_grad


def test_a_gpt2_built_on_the_tpu_device_runs_its_forward_in_torch_pallas_ops(fake):
    """register_attention's attention, and every dropout routed: embeddings, attention
    residual, MLP residual (one layer), the attention's inside the flash kernel."""
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    name = torch_pallas.register_attention()
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2, attn_pdrop=0.1,
                                     resid_pdrop=0.1, embd_pdrop=0.1, use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("tpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name)
    assert {parameter.device.type for parameter in model.parameters()} == {"tpu"}
    assert model.config._attn_implementation == name
    ids = torch.randint(3, 128, (2, 16), device="tpu")
    padding = torch.ones(2, 16, dtype=torch.long, device="tpu")
    with DispatchedOps() as dispatched, torch_pallas.route_dropout():
        output = model.train()(input_ids=ids, attention_mask=padding, labels=ids)
    assert collections.Counter(torch_pallas_ops(dispatched.names)) == {
        "torch_pallas::dropout": 3, "torch_pallas::attention": 1}
    assert not torch_noise_ops(dispatched.names), dispatched.names
    check_on_tpu(output.logits, (2, 16, 128), torch.float32)
    check_on_tpu(output.loss, (), torch.float32)


def test_the_fusing_options_route_without_fusing(fake):
    """docs/tour-torchtpu.md, What differs: the fusions take lazily run tensors only."""
    x, residual = torch.randn(SHAPE, device="tpu"), torch.randn(SHAPE, device="tpu")
    weights, value = torch.randn(2, 64, 64, device="tpu"), torch.randn(2, 64, 32, device="tpu")
    with DispatchedOps() as dispatched, torch_pallas.route_dropout():
        summed = residual + F.dropout(x, 0.1)
        multiplied = F.dropout(weights, 0.1) @ value
        # attention weights: their dropout draws the attention kernels' mask (docs/noise.md)
        attended = F.dropout(torch.softmax(weights, dim=-1), 0.1) @ value
    assert torch_pallas_ops(dispatched.names) == ["torch_pallas::dropout"] * 2 + ["torch_pallas::dropout_weights"]
    check_on_tpu(summed, SHAPE, torch.float32)
    check_on_tpu(multiplied, (2, 64, 32), torch.float32)
    check_on_tpu(attended, (2, 64, 32), torch.float32)


def test_sample_tokens_dispatches_its_op_and_its_kernel_reaches_torchtpu_as_a_jax_op(fake):
    from torch_pallas.ops import token_sampling

    logits = torch.randn(4, 1000, device="tpu", dtype=torch.bfloat16)
    tokens = check_dispatches(lambda: torch_pallas.sample_tokens(logits, [1, 2, 3, 2**64 - 1], [0, 1, 2, 3],
                                                                  temperature=0.7, top_p=0.9),
                              "torch_pallas::sample_tokens")
    check_on_tpu(tokens, (4,), torch.int64)
    words = torch.zeros(4, 2, dtype=torch.int32, device="tpu")
    rows = torch.zeros(4, dtype=torch.int32, device="tpu")
    arguments = (logits, words, rows, torch.ones(4, device="tpu"), None, torch.full((4,), 0.9, device="tpu"), None)
    check_kernel_op(token_sampling._compute_sample_tokens, arguments, "_jax_sample_tokens", [((4,), torch.int32)])
    check_kernel_op(token_sampling._compute_sample_tokens_with_logprobs, arguments, "_jax_sample_tokens",
                    [((4,), torch.int32), ((4,), torch.float32), ((4,), torch.float32)])
    sampled = check_dispatches(lambda: torch_pallas.sample_tokens(logits, [1, 2, 3, 4], [0, 1, 2, 3],
                                                                   return_logprobs=True),
                               "torch_pallas::sample_tokens_with_logprobs")
    for tensor, dtype in zip(sampled, (torch.int64, torch.float32, torch.float32)):
        check_on_tpu(tensor, (4,), dtype)
