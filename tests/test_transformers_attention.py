"""torch_pallas.register_attention: transformers models (4.57 on this stack) built with
attn_implementation="torch_pallas" run their attention in torch_pallas's flash kernels."""

import pytest
import torch
import torch_xla

import torch_pallas
from torch_pallas import bridge
from torch_pallas.kernels import attention as attention_kernels
from kernel_calls import TorchSDPACalls, record_dropout_keys

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers: pip install -e '.[test]'")

NAME = torch_pallas.register_attention()


def gpt2(attn_implementation=NAME):
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.1,
                                     resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def esm(attn_implementation=NAME):
    """BERT's architecture on transformers 4.57's attention interface (4.57's BERT is not on it)."""
    config = transformers.EsmConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, max_position_embeddings=40, attention_probs_dropout_prob=0.1,
                                    hidden_dropout_prob=0.0, pad_token_id=1, mask_token_id=2)
    return transformers.AutoModelForMaskedLM.from_config(config, attn_implementation=attn_implementation)


def llama(attn_implementation=NAME):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      attention_dropout=0.1, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def inputs():
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 11:] = 0
    return ids.to(torch_xla.device()), padding.to(torch_xla.device())


def test_registering_is_idempotent_and_leaves_transformers_own_names_alone():
    assert torch_pallas.register_attention() == NAME == "torch_pallas"
    function = transformers.AttentionInterface._global_mapping[NAME]
    assert torch_pallas.register_attention(NAME) == NAME
    assert NAME in transformers.AttentionInterface._global_mapping
    assert transformers.AttentionMaskInterface._global_mapping[NAME] is \
        transformers.AttentionMaskInterface._global_mapping["sdpa"]
    assert function is not None
    for taken in ("sdpa", "eager", "flash_attention_2"):
        with pytest.raises(ValueError, match="already registered"):
            torch_pallas.register_attention(taken)
    with pytest.raises(TypeError):
        torch_pallas.register_attention("")


@pytest.mark.parametrize("make_model", [gpt2, esm, llama])
def test_eval_outputs_equal_sdpa_with_a_padding_mask(make_model):
    """gpt2: a boolean mask; esm: an additive float mask; llama: GQA (2 query heads per kv head)."""
    torch.manual_seed(0)
    model = make_model().to(torch_xla.device()).eval()
    assert model.config._attn_implementation == NAME
    ids, padding = inputs()
    ours = model(input_ids=ids, attention_mask=padding).logits
    model.set_attn_implementation("sdpa")
    counter = TorchSDPACalls()
    with counter:
        theirs = model(input_ids=ids, attention_mask=padding).logits
    assert counter.calls == 2  # the sdpa run is torch's
    model.set_attn_implementation(NAME)  # a built model switches back
    counter = TorchSDPACalls()
    with counter:
        again = model(input_ids=ids, attention_mask=padding).logits
    assert counter.calls == 0
    torch.testing.assert_close(ours.cpu(), theirs.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again.cpu(), ours.cpu(), rtol=0, atol=0)


def test_bert_in_transformers_4_57_is_not_on_the_attention_interface():
    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("transformers 5's BERT calls through the interface (tests/torchax)")
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)
    with pytest.raises(KeyError, match=NAME):  # its own eager/sdpa classes, looked up by name
        transformers.AutoModel.from_config(config, attn_implementation=NAME)


@pytest.mark.parametrize("make_model", [gpt2, esm])
def test_training_runs_the_flash_kernels_with_dropout_and_learns(make_model, monkeypatch):
    torch.manual_seed(0)
    model = make_model().to(torch_xla.device()).train()
    layers = model.config.num_hidden_layers
    ids, padding = inputs()
    labels = ids.masked_fill(padding == 0, -100)
    keys = record_dropout_keys(monkeypatch)
    kernels, call = [], bridge.call  # record_dropout_keys' call, which this one calls
    monkeypatch.setattr(bridge, "call", lambda f, *t, **s: kernels.append(f) or call(f, *t, **s))
    counter = TorchSDPACalls()
    with counter:
        loss = model(input_ids=ids, attention_mask=padding, labels=labels).loss
    forward = list(keys)
    loss.backward()
    assert counter.calls == 0
    assert kernels.count(attention_kernels.attention_forward) == layers
    assert kernels.count(attention_kernels.attention_backward) == layers
    # one fresh key per layer with dropout 0.1, the backward kernels regenerating from the same keys
    assert len(forward) == len(set(forward)) == layers and sorted(keys[layers:]) == sorted(forward)
    # keys from the enclosing key_scope: the same scope key, the same attention keys
    with torch_pallas.seeds.key_scope(torch_pallas.seeds.key_data(seed=5)):
        model(input_ids=ids, attention_mask=padding)
    scoped = keys[len(keys) - layers:]
    with torch_pallas.seeds.key_scope(torch_pallas.seeds.key_data(seed=5)):
        model(input_ids=ids, attention_mask=padding)
    assert keys[len(keys) - layers:] == scoped and not set(scoped) & set(forward)

    monkeypatch.undo()  # recording fetches every key, which syncs the graph at every call
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=padding, labels=labels).loss
        loss.backward()
        optimizer.step()
        torch_xla.sync()  # one graph per step, as torch_xla trains
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_attention_forward_mirrors_sdpa_on_position_bias_float32_masks_and_single_queries():
    """What no model above passes: transformers 5's position_bias (with a boolean mask, or
    causal), a float32 mask beside bfloat16 activations, explicit is_causal with one query."""
    from torch_pallas.transformers_attention import attention_forward

    layer = torch.nn.Module().eval()
    layer.num_key_value_groups, layer.is_causal = 2, True
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 8, 16, generator=generator) for heads in (4, 2, 2))
    bias = torch.randn(1, 4, 8, 8, generator=generator)
    mask = torch.ones(2, 1, 8, 10, dtype=torch.bool)
    mask[1, :, :, 5:] = False
    device = torch_xla.device()
    k_rep, v_rep = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    cases = [  # (our arguments, torch's SDPA arguments)
        (dict(attention_mask=mask, position_bias=bias),
         dict(attn_mask=torch.where(mask[..., :8], bias, torch.finfo(bias.dtype).min))),
        (dict(attention_mask=None, position_bias=bias),
         dict(attn_mask=torch.where(causal, bias, torch.finfo(bias.dtype).min))),
        (dict(attention_mask=None, is_causal=False), dict()),
    ]
    for ours, theirs in cases:
        ours = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in ours.items()}
        output, weights = attention_forward(layer, q.to(device), k.to(device), v.to(device), dropout=0.1, **ours)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, **theirs).transpose(1, 2)
        assert weights is None and output.shape == (2, 8, 4, 16)
        torch.testing.assert_close(output.cpu(), expected, rtol=1e-5, atol=1e-5)  # eval: no dropout
    # a float32 additive mask (finfo(float32).min) beside bfloat16 activations
    additive = torch.zeros(2, 1, 8, 8).masked_fill(~mask[..., :8], torch.finfo(torch.float32).min)
    output, _ = attention_forward(layer, *(t.to(device, torch.bfloat16) for t in (q, k, v)), additive.to(device))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask[..., :8])
    torch.testing.assert_close(output.float().cpu(), expected.transpose(1, 2), rtol=2e-2, atol=2e-2)
    # one query attends to every key even when is_causal=True is passed (top-left causal would not)
    output, _ = attention_forward(layer, q[:, :, :1].to(device), k.to(device), v.to(device), None, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q[:, :, :1], k_rep, v_rep).transpose(1, 2)
    torch.testing.assert_close(output.cpu(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        attention_forward(layer, q, k, v, None, softcap=30.0)
