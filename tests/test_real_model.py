"""A Hugging Face OPT model (small config, no weights) with every dropout routed to
torch_pallas and its layers checkpointed by torch_pallas.checkpoint: the example's run."""

import collections
import sys
from pathlib import Path

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as metrics

import torch_pallas
from torch_pallas import residual_fusion
from torch_pallas.kernels import heads_in_lanes
from kernel_calls import record_dropout_keys

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers: pip install -e '.[test]'")
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import train_transformer  # noqa: E402


def test_every_dropout_is_routed_and_recomputation_reuses_the_forward_keys(monkeypatch):
    torch.manual_seed(0)
    model = train_transformer.make_model().to(torch_xla.device()).train()
    ids = next(train_transformer.batches(torch.Generator().manual_seed(0))).to(torch_xla.device())
    loss = model(input_ids=ids, labels=ids).loss
    torch_dropouts = torch_xla._XLAC._get_xla_tensors_text([loss]).count("bernoulli")  # unrouted
    keys = record_dropout_keys(monkeypatch)
    with torch_pallas.route_dropout():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch_xla._XLAC._get_xla_tensors_text([loss]).count("bernoulli") == 0
    forward = list(keys)
    loss.backward()
    backward = keys[len(forward):]
    # Each of torch's dropouts became one torch_pallas dropout with its own key (eager attention's
    # drawn by its dropped weights' kernel, dead, and by the fused attention kernel that reads them),
    # and the checkpointed recomputation drew the same keys, each as often, the backward kernels once more.
    assert torch_dropouts > 0 and len(set(forward)) == torch_dropouts
    recomputed = collections.Counter(backward) - collections.Counter(forward)
    assert set(backward) == set(forward) and sorted(recomputed.elements()) == sorted(set(forward))


def test_compiled_training_with_checkpointing_learns_and_compiles_nothing_after_warm_up():
    """docs/transformers.md, A whole example (train_transformer.py): the loss falls by more than 0.5 in
    8 steps, no XLA compile after the third."""
    losses, compiles = train_transformer.train(steps=8)
    assert compiles[2] == compiles[-1], compiles
    assert losses[-1] < losses[0] - 0.5, losses


def gpt2_on_sdpa(attn_implementation="sdpa"):
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.1,
                                     resid_pdrop=0.1, embd_pdrop=0.1, use_cache=False,
                                     attn_implementation=attn_implementation)
    return transformers.GPT2LMHeadModel(config)


def bert_on_sdpa():
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    return transformers.BertForMaskedLM(config)


def llama_on_sdpa():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      attention_dropout=0.1, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def test_checkpoint_enable_recomputes_every_layer_with_its_forward_keys_and_trains(monkeypatch):
    torch.manual_seed(0)
    model = gpt2_on_sdpa().to(torch_xla.device()).train()  # sdpa: its attention dropout is routed too
    assert torch_pallas.checkpoint.enable(model) is model and model.is_gradient_checkpointing
    ids = torch.randint(0, 128, (2, 16)).to(torch_xla.device())
    keys = record_dropout_keys(monkeypatch)
    layer_keys = []  # per GPT2Block: the keys its forward drew
    hooks = [block.register_forward_pre_hook(lambda *_: layer_keys.append(len(keys))) for block in model.transformer.h]
    with torch_pallas.route_dropout():
        loss = model(input_ids=ids, labels=ids).loss
    for hook in hooks:
        hook.remove()
    forward = list(keys)
    layer_keys = [forward[start:end] for start, end in zip(layer_keys, layer_keys[1:] + [len(forward)])]
    loss.backward()
    recomputed = collections.Counter(keys[len(forward):]) - collections.Counter(forward)  # less the backward kernels
    assert [len(drawn) for drawn in layer_keys] == [3, 3] and len(forward) == len(set(forward)) == 7
    # every layer drew its forward's keys again, and nothing else was recomputed (the embedding dropout)
    assert sorted(recomputed.elements()) == sorted(sum(layer_keys, []))

    monkeypatch.undo()  # recording fetches every key, which syncs the graph at every call
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        with torch_pallas.route_dropout():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        torch_xla.sync()  # a training step, as torch_xla runs one: without it each graph holds the last's
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses

    model.gradient_checkpointing_disable()  # transformers' own method works on XLA as is
    keys = record_dropout_keys(monkeypatch)
    with torch_pallas.route_dropout():
        model(input_ids=ids, labels=ids).loss.backward()
    assert not model.is_gradient_checkpointing and len(keys) == 2 * len(forward)  # no recomputation


def test_checkpoint_enable_rejects_models_without_checkpointing():
    unsupported = transformers.CTRLLMHeadModel(transformers.CTRLConfig(vocab_size=16, n_embd=8, n_layer=1, n_head=2,
                                                                        dff=16, n_positions=8))
    with pytest.raises(ValueError, match="does not support gradient checkpointing") as error:
        torch_pallas.checkpoint.enable(unsupported)
    with pytest.raises(type(error.value)):  # as transformers' own method
        unsupported.gradient_checkpointing_enable()
    with pytest.raises(TypeError, match="a Hugging Face transformers model"):
        torch_pallas.checkpoint.enable(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="use_reentrant=False"):
        torch_pallas.checkpoint.enable(gpt2_on_sdpa(), use_reentrant=False)
    with pytest.raises(TypeError):
        torch_pallas.checkpoint.enable(gpt2_on_sdpa(), gradient_checkpointing_kwargs={})


def torchs_dropouts(graph: torch.fx.GraphModule) -> list[str]:
    """The calls in dynamo's graph that would draw a dropout mask with torch's RNG."""
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    return [target for target in targets if "torch_pallas" not in target
            and any(name in target for name in ("bernoulli", "dropout", "scaled_dot_product_attention"))]


# (BERT on sdpa also trains in test_bert_over_128_tokens_runs_its_attention_with_heads_in_lanes_and_trains)
@pytest.mark.parametrize("make_model, residual_dropouts", [(gpt2_on_sdpa, 4),
                                                           pytest.param(bert_on_sdpa, 4, marks=pytest.mark.slow),
                                                           (llama_on_sdpa, 0)])
def test_routed_model_on_sdpa_attention_has_no_torch_dropout_compiles_fullgraph_and_trains(make_model,
                                                                                          residual_dropouts,
                                                                                          monkeypatch):
    """docs/transformers.md, Routing: every dropout of GPT-2, BERT and Llama on their default sdpa attention
    (attention dropout included) is torch_pallas's, eager and compiled. A padding mask makes
    transformers pass attn_mask to every layer. (A warning on a traced path once broke these
    compiles, and torch_xla merged the layers' saved masks.) Compiled with the torch_pallas
    backend, the residual dropouts (two per layer; Llama has none) are fused into dropout_add."""
    fused = []
    fuse = residual_fusion.fuse_residual_dropouts
    monkeypatch.setattr(residual_fusion, "fuse_residual_dropouts", lambda graph: fused.append(fuse(graph)))
    torch.manual_seed(0)
    model = make_model().to(torch_xla.device()).train()
    assert model.config._attn_implementation == "sdpa"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, 128, (2, 16)).to(torch_xla.device())
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 12:] = 0
    padding = padding.to(torch_xla.device())
    assert torch_xla._XLAC._get_xla_tensors_text([model(input_ids=ids).logits]).count("bernoulli") > 0

    def loss_of(ids, padding):
        with torch_pallas.route_dropout():
            logits = model(input_ids=ids, attention_mask=padding).logits  # (HF's own loss function logs, which dynamo refuses)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))

    assert torch_xla._XLAC._get_xla_tensors_text([loss_of(ids, padding)]).count("bernoulli") == 0
    graphs = []

    def inspecting_torch_pallas(graph, example_inputs):
        graphs.append(graph)
        return residual_fusion.backend(graph, example_inputs)

    step = torch.compile(loss_of, backend=inspecting_torch_pallas, fullgraph=True)
    losses, compiles = [], []
    for _ in range(4):
        loss = step(ids, padding)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
        compiles.append(metrics.metric_data("CompileTime")[0])
    assert compiles[1] == compiles[-1], compiles
    assert losses[-1] < losses[0] - 0.3, losses
    assert len(graphs) == 1 and torchs_dropouts(graphs[0]) == []
    assert fused[0] == residual_dropouts, fused  # the forward graph's; the backward fuses gradient sums too


# Per attention: the module and functions of its kernels on the models' layout, and the routing.
HEADS_IN_LANES = {"sdpa": (heads_in_lanes, ("forward", "backward"), {}),
                  "eager": (heads_in_lanes, ("forward", "backward"), {"fuse_matmul": True})}


# Eager attention's route to these kernels is checked faster in tests/test_residual_fusion.py (BERT's
# layers, and eager attention in lanes at torch level): the eager model here is in the slow tier.
@pytest.mark.parametrize("attention", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_bert_over_128_tokens_runs_its_attention_with_heads_in_lanes_and_trains(monkeypatch, attention):
    """docs/transformers.md, Routing: BERT's sdpa attention over 128 tokens (head dim 64, a padding
    mask, the same for every head) runs kernels.heads_in_lanes forward and backward, and learns;
    so does its eager attention, whole (its scores q @ k.T / 8 + the mask: route_dropout(fuse_matmul=True))."""
    module, phases, fusion = HEADS_IN_LANES[attention]
    ran = []
    for phase in phases:
        kernel = getattr(module, phase)
        monkeypatch.setattr(module, phase,
                            lambda *args, _kernel=kernel, _phase=phase, **options: ran.append(_phase)
                            or _kernel(*args, **options))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=128,
                                     attn_implementation=attention)
    model = transformers.BertForMaskedLM(config).to(torch_xla.device()).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, 128, (2, 128)).to(torch_xla.device())
    padding = torch.ones(2, 128, dtype=torch.long)
    padding[1, 100:] = 0
    padding = padding.to(torch_xla.device())
    losses = []
    for _ in range(4):
        with torch_pallas.route_dropout(impl="tiled", **fusion):
            logits = model(input_ids=ids, attention_mask=padding).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), ids.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
    assert ran == list(phases), ran  # traced once, then cached
    assert losses[-1] < losses[0] - 0.3, losses
