"""route_dropout as a user combines it with the rest of torch, on CPU tensors, stated once for every
stack (issue 71): torch's own checkpoints (both modes, ``backward()`` inside the scope or after
it, transformers' ``gradient_checkpointing_enable()``) recompute the forward's masks;
``torch.compile(fullgraph=True)`` (inductor) traces the mode, training and evaluation; ``torch.fx``
records converted dropout modules as leaves, and transformers' fx tracer traces converted models
in training (it runs each module on meta tensors, which torch_pallas's ops take as torch's do:
shapes only); attention weights draw the attention kernels' mask wherever they run.

Not a test module: tests/test_routing_cases.py (xla stack), tests/torchax/test_routing_cases.py and
tests/torchtpu/test_routing_cases.py import the ``test_*`` functions below.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import torch_pallas
from kernel_calls import record_dropout_keys
from torch_pallas import seeds

transformers = pytest.importorskip("transformers")


class Region(torch.nn.Module):
    """A checkpointed region whose dropout's mask shows in its input's gradient: ``x``'s gradient
    of ``dropout(linear(x)).sum()`` is ``(mask / (1 - p)) @ weight``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(128, 128)

    def forward(self, x):
        return F.dropout(self.linear(x), 0.5, self.training)


def gradient_of_the_forward_mask(region, out):
    """What ``x``'s gradient is if the backward pass used the mask the forward's output holds."""
    return ((out != 0).float() * 2) @ region.linear.weight.detach()


@pytest.mark.parametrize("backward", ["inside", "after"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_torch_checkpoint_recomputes_the_forward_masks(use_reentrant, backward):
    """Autograd runs the backward pass, where the recomputation happens, outside every function mode:
    the region is recomputed routed as its forward ran (torch's dropout would draw other masks, and
    non-reentrant checkpointing would find other saved tensors and raise), with the forward's keys
    whatever preserve_rng_state restores."""
    region = Region()
    for preserve_rng_state in (True, False):
        x = torch.randn(16, 8, 128, requires_grad=True)
        with torch_pallas.route_dropout():
            out = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=use_reentrant,
                                                    preserve_rng_state=preserve_rng_state)
            if backward == "inside":
                out.sum().backward()
        if backward == "after":
            out.sum().backward()
        assert 0.4 < (out == 0).float().mean() < 0.6
        torch.testing.assert_close(x.grad, gradient_of_the_forward_mask(region, out), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_entered_outside_the_scope_stays_torchs():
    region = Region()
    x = torch.randn(16, 128, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)
    out.sum().backward()
    torch.testing.assert_close(x.grad, gradient_of_the_forward_mask(region, out), rtol=1e-5, atol=1e-5)


def tiny_bert(**options):
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, **options)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_transformers_gradient_checkpointing_recomputes_the_forward_masks(use_reentrant, monkeypatch):
    """A BERT with eager attention, ``gradient_checkpointing_enable()`` (torch's checkpoint, which
    transformers, PEFT and FSDP2 use), ``backward()`` after the scope: every dropout kernel of the
    backward pass (recomputation and gradients) draws a key of the forward's, each as often
    (before: none ran, torch's dropout recomputed with other masks)."""
    model = tiny_bert(attn_implementation="eager", hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    keys = record_dropout_keys(monkeypatch)
    with torch_pallas.route_dropout():
        loss = model(input_ids=ids, labels=ids).loss
    forward = list(keys)
    loss.backward()
    # 2 layers: attention weights, attention output and output dropouts each; and the embeddings'
    assert len(forward) == 7 and len(set(forward)) == 7
    # (the embeddings' dropout is outside the checkpointed layers: its backward only)
    assert collections.Counter(keys[len(forward):]) == collections.Counter(forward[:1] + forward[1:] * 2)


class Attention(torch.nn.Module):
    """Eager attention as models write it, a dict mutated on the way (what a KV cache or a
    config's ``setdefault`` does; dynamo could not read inspect's mapping proxies after it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.projection = torch.nn.Linear(64, 64)
        self.dropout = torch.nn.Dropout(0.3)
        self.calls = {}

    def forward(self, x):
        self.calls["forward"] = self.calls.get("forward", 0) + 1
        # (not unflatten: torch <= 2.12's dynamo cannot trace it under any function mode)
        q = k = v = self.projection(x).view(*x.shape[:-1], 4, 16).transpose(1, 2)
        weights = torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1)
        weights = self.dropout(F.dropout(weights, 0.2, self.training))
        out = (weights @ v).transpose(1, 2).flatten(-2)
        return F.dropout(out, 0.1, self.training) + x, weights


def compile_failure() -> str | None:
    """Why ``torch.compile`` fails on this stack for any module (``None``: it works). torch 2.12's
    dynamo asks the current accelerator for its device index, and torchax 0.0.13 makes "jax" that
    accelerator, which torch cannot index ("not linked with support for jax devices"): on the
    torchax stack steps compile with jax.jit (tests/torchax/test_compiled.py)."""
    torch._dynamo.reset()
    try:
        torch.compile(torch.nn.Identity(), fullgraph=True)(torch.ones(1))
    except Exception as error:  # what dynamo raises depends on the torch
        return f"torch.compile of an Identity module fails here: {type(error).__name__}: {str(error)[:200]}"
    return None


@pytest.mark.parametrize("converted", [False, True], ids=["routed", "converted"])
def test_fullgraph_compile_traces_the_routing_with_the_eager_masks(converted):
    """``torch.compile(fullgraph=True)`` (inductor, CPU tensors) of a module inside route_dropout:
    in eval mode the identity, in training mode the eager call's values and attention weights for
    the same keys (a key scope), the attention weights' mask the attention kernels' one."""
    failure = compile_failure()
    if failure is not None:
        pytest.skip(failure)
    module = Attention()
    if converted:
        module = torch_pallas.convert_dropout(module)
    x = torch.randn(2, 40, 64)
    key = seeds.key_data(seed=3, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    for training in (False, True):
        module.train(training)
        results = []
        for step in (module, compiled):
            with seeds.key_scope(key), torch_pallas.route_dropout():
                results.append(step(x))
        (eager, eager_weights), (got, got_weights) = results
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_weights != 0, eager_weights != 0)
        if not training:
            assert (got_weights != 0).all()


@pytest.mark.parametrize("softmax", ["F.softmax", "float32 softmax, .to(bfloat16)", "Tensor.softmax, .type_as"])
def test_a_dropout_of_attention_weights_draws_the_attention_kernels_mask(softmax):
    """A softmax over the last dim inside route_dropout gives attention weights (and so do its dtype
    conversions): their dropout draws the mask torch_pallas.dropout_matmul (and the attention
    kernels) draw for them, so that the product fused or not, or the weights read elsewhere, agree;
    with the per-tile impls not torch_pallas.dropout's for the same key. A softmax over another dim
    is not attention weights."""
    scores = torch.randn(2, 3, 40, 72) * 3
    make = {"F.softmax": lambda s: F.softmax(s, dim=-1),
            "float32 softmax, .to(bfloat16)": lambda s: F.softmax(s.bfloat16(), -1, dtype=torch.float32).to(s.dtype),
            "Tensor.softmax, .type_as": lambda s: s.softmax(-1).type_as(s)}[softmax]
    key = seeds.key_data(seed=11, device="cpu")
    identity = torch.eye(72).expand(2, 3, 72, 72).contiguous()
    with seeds.key_scope(key), torch_pallas.route_dropout():
        weights = make(scores)
        routed = F.dropout(weights, 0.3)
        across = F.dropout(F.softmax(scores, dim=-2), 0.3)
    with seeds.key_scope(key):  # the same keys in the same order
        kernels = torch_pallas.dropout_matmul(weights, identity, 0.3) != 0  # (exact: one 1 per column)
        elementwise = torch_pallas.dropout(F.softmax(scores, dim=-2), 0.3) != 0
    assert torch.equal(routed != 0, kernels) and torch.equal(across != 0, elementwise)
    with seeds.key_scope(key):
        assert not torch.equal(torch_pallas.dropout(weights, 0.3) != 0, kernels)  # tiled: not dropout's mask


def test_fx_records_converted_dropouts_as_leaf_modules():
    """``torch.fx.symbolic_trace`` of a converted model: each torch_pallas dropout module one
    ``call_module`` node, as torch's own are, run when the traced graph runs; inside route_dropout
    fx records the model's functions as written."""
    model = torch_pallas.convert_dropout(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Dropout(0.5),
                                                             torch.nn.ReLU(), torch.nn.Dropout1d(0.5)))
    traced = torch.fx.symbolic_trace(model)
    modules = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert modules == ["0", "1", "2", "3"]
    x = torch.randn(8, 128)
    for training in (True, False):
        model.train(training), traced.train(training)
        torch.manual_seed(5)
        expected = model(x)
        torch.manual_seed(5)
        assert torch.equal(traced(x), expected)
    with torch_pallas.route_dropout():
        routed = torch.fx.symbolic_trace(lambda x: F.dropout(torch.softmax(x, -1), 0.5))
    assert [node.target for node in routed.graph.nodes if node.op == "call_function"] == [torch.softmax, F.dropout]


def test_meta_tensors_give_the_shapes_torchs_ops_give():
    """Meta tensors (shapes only: transformers' fx tracer, models built on ``device="meta"``) go
    through each op's fake function, forward and backward, as torch's ops on meta tensors do."""
    x = torch.empty(2, 3, 8, 16, device="meta", requires_grad=True)
    weight = torch.empty(5, 16, device="meta", requires_grad=True)
    calls = {
        "dropout": (lambda: torch_pallas.dropout(x, 0.1), x.shape),
        "dropout(seed=)": (lambda: torch_pallas.dropout(x, 0.1, seed=3), x.shape),
        "nn.Dropout2d": (lambda: torch_pallas.nn.Dropout2d(0.1)(x), x.shape),
        "dropout_add": (lambda: torch_pallas.dropout_add(x, x, 0.1), x.shape),
        "dropout_linear": (lambda: torch_pallas.dropout_linear(x, weight, None, 0.1), (2, 3, 8, 5)),
        "dropout_matmul": (lambda: torch_pallas.dropout_matmul(x, x.transpose(-1, -2), 0.1), (2, 3, 8, 8)),
        "attention": (lambda: torch_pallas.scaled_dot_product_attention(x, x, x, dropout_p=0.1), x.shape),
        "routed attention weights": (lambda: _routed_weights(x), (2, 3, 8, 16)),
        "nn.IndRNN": (lambda: torch_pallas.nn.IndRNN(16, 16).to("meta")(x[0])[0], (3, 8, 16)),
        "random.uniform": (lambda: torch_pallas.random.uniform((3, 4), device="meta"), (3, 4)),
    }
    for name, (call, shape) in calls.items():
        output = call()
        assert output.is_meta and output.shape == shape and output.dtype == torch.float32, name
        if output.requires_grad:
            x.grad = weight.grad = None
            output.sum().backward()
            assert x.grad.is_meta and x.grad.shape == x.shape, name
    assert seeds.key_data(device="meta").is_meta


def _routed_weights(x):
    with torch_pallas.route_dropout():
        return F.dropout(torch.softmax(x, dim=-1), 0.1) @ x.transpose(-1, -2) @ x


def test_transformers_fx_traces_a_converted_model_in_training():
    """transformers' ``symbolic_trace`` of a converted T5 in train mode (its tracer computes each
    module's output on meta tensors, and T5's layers branch on its dtype): the traced graph, run
    from the same seed, gives the model's loss."""
    fx = pytest.importorskip("transformers.utils.fx", reason="transformers 5 has no torch.fx tracer")
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, dropout_rate=0.3)
    torch.manual_seed(0)
    model = torch_pallas.convert_dropout(transformers.T5ForConditionalGeneration(config)).train()
    traced = fx.symbolic_trace(model, ["input_ids", "labels"])
    dropouts = [node for node in traced.graph.nodes if node.op == "call_module"
                and isinstance(traced.get_submodule(node.target), torch_pallas.nn.Dropout)]
    assert dropouts
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    expected = model(input_ids=ids, labels=ids).loss
    torch.manual_seed(5)
    assert torch.equal(traced(input_ids=ids, labels=ids)["loss"], expected)


# Slow (a minute or two here): the mode's eval-mode path under fullgraph is in the default run
# (test_fullgraph_compile_traces_the_routing_with_the_eager_masks), a whole model's in tests/test_thirdparty.py.
@pytest.mark.slow
def test_generate_with_a_compiled_forward_inside_route_dropout():
    """transformers' ``generate`` with the model's forward compiled (``fullgraph=True``, a static
    cache, as transformers' own compiled-generation test does it) inside route_dropout, the model
    in eval mode (every dropout the identity): the eager generation's tokens."""
    failure = compile_failure()
    if failure is not None:
        pytest.skip(failure)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    with torch_pallas.route_dropout():
        eager = model.generate(ids, **options)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, fullgraph=True)
        compiled = model.generate(ids, **options)
    assert torch.equal(compiled, eager) and compiled.shape == (2, 9)
