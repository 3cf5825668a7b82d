"""torch_pallas.register_attention on torchax: transformers 5 models (GPT-2, BERT) built with
attn_implementation="torch_pallas" run their attention in torch_pallas's flash kernels, eager
and in a jitted training step whose dropout keys are an input."""

import contextlib

import jax
import pytest
import torch
import torchax
from torchax import interop

import torch_pallas
from torch_pallas import bridge
from torch_pallas.kernels import attention as attention_kernels
from kernel_calls import TorchSDPACalls, record_dropout_keys

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

ENV = torchax.default_env()
NAME = torch_pallas.register_attention()


def gpt2(attn_implementation=NAME):
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.1,
                                     resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def bert(attn_implementation=NAME):
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, attention_probs_dropout_prob=0.1,
                                     hidden_dropout_prob=0.0)
    return transformers.AutoModelForMaskedLM.from_config(config, attn_implementation=attn_implementation)


def on_jax(make_model, train):
    torch.manual_seed(0)
    model = make_model().train(train)
    with ENV:
        model.to("jax")
    return model


def inputs():
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 11:] = 0
    labels = ids.masked_fill(padding == 0, -100)
    with ENV:
        return ids.to("jax"), padding.to("jax"), labels.to("jax")


def test_registering_twice_is_harmless():
    function = transformers.AttentionInterface._global_mapping[NAME]
    assert torch_pallas.register_attention() == NAME
    assert transformers.AttentionInterface._global_mapping[NAME] is not None and function is not None
    assert transformers.AttentionMaskInterface._global_mapping[NAME] is \
        transformers.AttentionMaskInterface._global_mapping["sdpa"]
    with pytest.raises(ValueError, match="already registered"):
        torch_pallas.register_attention("sdpa")


@pytest.mark.parametrize("make_model", [gpt2, bert])
def test_eval_outputs_equal_sdpa_with_a_padding_mask(make_model):
    model = on_jax(make_model, train=False)
    assert model.config._attn_implementation == NAME
    ids, padding, _ = inputs()
    with ENV:
        counter = TorchSDPACalls()
        with counter:
            ours = model(input_ids=ids, attention_mask=padding).logits
        assert counter.calls == 0
        model.set_attn_implementation("sdpa")
        with counter:
            theirs = model(input_ids=ids, attention_mask=padding).logits
        assert counter.calls == model.config.num_hidden_layers  # the sdpa run is torch's (torchax's)
        model.set_attn_implementation(NAME)
        again = model(input_ids=ids, attention_mask=padding).logits
        torch.testing.assert_close(ours.cpu(), theirs.cpu(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again.cpu(), ours.cpu(), rtol=0, atol=0)


def make_step(model, learning_rate=0.5, mode=contextlib.nullcontext()):
    """A jitted SGD step ``(params, buffers, ids, padding, labels, key_data) -> (loss, params)``,
    as examples/train_torchax.py builds one: the dropout keys an input."""
    jittable = interop.JittableModule(model)

    def loss_of(params, buffers, ids, padding, labels, key_data):
        with ENV, mode, torch_pallas.seeds.key_scope(key_data):  # mode: inside torchax's, to see SDPA calls
            return jittable.functional_call("forward", params, buffers, input_ids=ids, attention_mask=padding,
                                            labels=labels).loss

    value_and_grad = interop.jax_value_and_grad(loss_of)

    def step(params, buffers, ids, padding, labels, key_data):
        loss, grads = interop.jax_view(value_and_grad(params, buffers, ids, padding, labels, key_data))
        return loss, jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)

    return step, interop.jax_view(jittable.params), interop.jax_view(jittable.buffers)


@pytest.mark.parametrize("make_model", [gpt2, bert])
def test_training_runs_the_flash_kernels_with_dropout_and_learns_under_jit(make_model, monkeypatch):
    model = on_jax(make_model, train=True)
    layers = model.config.num_hidden_layers
    ids, padding, labels = inputs()
    step, params, buffers = make_step(model)
    arrays = interop.jax_view((ids, padding, labels))
    with ENV:
        key_data = interop.jax_view(torch_pallas.seeds.key_data(seed=1))
    # Not jitted (concrete keys): one key per layer's attention dropout, which the backward
    # kernels regenerate; the same step key, the same attention keys (key_scope).
    keys = record_dropout_keys(monkeypatch)
    step(params, buffers, *arrays, key_data)
    forward = keys[:layers]
    assert len(keys) == 2 * layers and len(set(keys)) == layers and set(keys) == set(forward)
    step(params, buffers, *arrays, key_data)
    assert keys[2 * layers:] == keys[:2 * layers]
    monkeypatch.undo()

    kernels, statics, call = [], [], bridge.call
    monkeypatch.setattr(bridge, "call", lambda f, *t, **s: kernels.append(f) or statics.append(s) or call(f, *t, **s))
    counter = TorchSDPACalls()
    jax.make_jaxpr(make_step(model, mode=counter)[0])(params, buffers, *arrays, key_data)
    monkeypatch.undo()
    assert counter.calls == 0  # no torch (torchax) SDPA traced
    assert kernels.count(attention_kernels.attention_forward) == layers
    assert kernels.count(attention_kernels.attention_backward) == layers
    assert all(s["dropout_p"] == pytest.approx(0.1) for f, s in zip(kernels, statics)
               if f in (attention_kernels.attention_forward, attention_kernels.attention_backward))

    compiled = jax.jit(step)
    losses = []
    for _ in range(4):
        with ENV:
            key_data = interop.jax_view(torch_pallas.seeds.key_data())  # fresh each step, outside the trace
        loss, params = compiled(params, buffers, *arrays, key_data)
        losses.append(float(loss))
    assert compiled._cache_size() == 1
    assert losses[-1] < losses[0] - 0.3, losses


def test_transformers_is_imported_by_registering_only_and_missing_or_old_ones_are_named(monkeypatch):
    import subprocess
    import sys
    import types

    check = "import sys, torch_pallas; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", check], check=True)
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    with pytest.raises(ImportError, match="needs Hugging Face transformers"):
        torch_pallas.register_attention()
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.47.1"))
    with pytest.raises(ImportError, match=r"transformers >= 4\.48 .* 4\.47\.1 is installed"):
        torch_pallas.register_attention()
