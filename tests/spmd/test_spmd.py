"""Sharded (SPMD) tensors on 4 CPU devices; run by tests/test_sharding.py in a process of their own
(SPMD mode is process-wide), with XLA dumping every compiled module so the tests can read the
partitioned HLO."""

import functools
import os

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()

import torch_pallas  # noqa: E402
from attention_cases import sharded_case  # noqa: E402
from conftest import read_together  # noqa: E402
from hlo_dump import all_gather_sizes, compiled_modules  # noqa: E402
from sampling_cases import sharded_logits_case  # noqa: E402

DEVICE = torch_xla.device()
MESHES = {"4x1": (4, 1), "1x4": (1, 4), "2x2": (2, 2)}


def mesh_of(name):
    return xs.Mesh(np.arange(4), MESHES[name], ("data", "model"))


def sharded(tensor, mesh, spec):
    tensor = tensor.to(DEVICE)
    xs.mark_sharding(tensor, mesh, spec)
    return tensor


def spec_of(tensor):
    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


# Partition specs of a 2-D and a 3-D tensor, one of each kind: the first dim, the last, both (mesh
# axes swapped), a dim replicated over a mesh axis, a middle dim, two mesh axes on one dim.
CASES = [
    ("4x1", (16, 512), ("data", None)), ("1x4", (16, 512), (None, "model")), ("2x2", (16, 512), ("model", "data")),
    ("2x2", (16, 512), (None, "model")), ("2x2", (8, 4, 256), ("data", None, "model")),
    ("2x2", (8, 4, 256), (None, "data", "model")), ("2x2", (8, 4, 256), (("data", "model"), None, None)),
]
IDS = [f"{mesh}-{'x'.join(map(str, shape))}-{spec}" for mesh, shape, spec in CASES]


# The mask shared over the first dim: on a split first dim, on the 3-D tensors.
SHARED = [(case, True) for case in CASES if case[2][0] is not None or len(case[1]) == 3]


# The case: a quarter of the one band of its (64, 256) tile a shard.
ROWS_OF_A_BAND = ("4x1", (64, 256), ("data", None))


@pytest.mark.parametrize("case,shared,impl", [(case, False, None) for case in CASES + [ROWS_OF_A_BAND]]
                         + [(case, True, None) for case, _ in SHARED] + [(CASES[4], False, "threefry")],
                         ids=IDS + ["4x1-64x256-rows-of-a-band"] + [f"{IDS[CASES.index(case)]}-shared-mask"
                                                                    for case, _ in SHARED] + [f"{IDS[4]}-threefry"])
def test_dropout_mask_and_gradient_are_the_unsharded_ones(case, shared, impl):
    """The default (tiled: shards that are not whole bands of its tiles drawn in the bands that
    cover them) and threefry (drawn per element) take any of these splits."""
    mesh, shape, spec = case
    values = torch.rand(shape) + 0.5
    whole = values.to(DEVICE).requires_grad_(True)
    expected = torch_pallas.dropout(whole, 0.4, seed=7, shared_over_first_dim=shared, impl=impl)
    expected.backward(torch.ones(shape, device=DEVICE))
    x = sharded(values, mesh_of(mesh), spec).requires_grad_(True)
    y = torch_pallas.dropout(x, 0.4, seed=7, shared_over_first_dim=shared, impl=impl)
    y.backward(torch.ones(shape, device=DEVICE))
    assert spec_of(y) == spec_of(x) and spec_of(x.grad) == spec_of(x)
    torch.testing.assert_close(y.cpu(), expected.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad.cpu(), whole.grad.cpu(), rtol=0, atol=0)
    assert torch.equal(x.grad.cpu() != 0, expected.cpu() != 0)


@pytest.mark.parametrize("mesh,spec", [("4x1", ("data", None)), ("2x2", (("data", "model"), None))])
def test_tiled_dropout_on_shards_of_whole_tile_bands_is_the_unsharded_one(mesh, spec):
    shape = (256, 1024)  # (64, 1024) tiles: a band of them per shard
    values = torch.rand(shape) + 0.5
    expected = torch_pallas.dropout(values.to(DEVICE), 0.4, seed=7, impl="tiled").cpu()
    x = sharded(values, mesh_of(mesh), spec).requires_grad_(True)
    y = torch_pallas.dropout(x, 0.4, seed=7, impl="tiled")
    y.backward(torch.ones(shape, device=DEVICE))
    assert spec_of(y) == spec_of(x)
    torch.testing.assert_close(y.cpu(), expected, rtol=0, atol=0)
    assert torch.equal(x.grad.cpu() != 0, expected != 0)


@pytest.mark.parametrize("distribution", ["uniform", "normal", "bernoulli"])
@pytest.mark.parametrize("mesh,shape,spec", CASES[2:3] + CASES[4:5], ids=IDS[2:3] + IDS[4:5])
def test_random_with_a_mesh_is_the_unsharded_tensor_sharded(distribution, mesh, shape, spec):
    sample = getattr(torch_pallas.random, distribution)
    out = sample(shape, seed=11, mesh=mesh_of(mesh), partition_spec=spec)
    reference = torch.empty(shape).to(DEVICE)
    xs.mark_sharding(reference, mesh_of(mesh), spec)
    assert spec_of(out) == spec_of(reference)
    torch.testing.assert_close(out.cpu(), sample(shape, seed=11).cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("impl,shape,spec", [(None, (256, 1024), ("data", None)), (None, (64, 512), ("data", "model")),
                                             ("threefry", (64, 512), ("data", "model"))],
                         ids=["default", "default-covering-bands", "threefry"])
def test_dropout_forward_and_backward_run_per_shard_without_all_gather(impl, shape, spec):
    x = sharded(torch.rand(shape), mesh_of("2x2"), spec).requires_grad_(True)

    def run():
        torch_pallas.dropout(x, 0.5, seed=1, impl=impl).sum().backward()
        torch_xla.sync()
    assert "SPMDFullToShardShape" in torch_xla._XLAC._get_xla_tensors_hlo(
        [torch_pallas.dropout(x, 0.5, seed=1, impl=impl)])
    modules = compiled_modules(run)
    assert modules and all_gather_sizes(modules) == []


# (x's shape, its partition spec on the 2x2 mesh, the weight's, impl): FSDPv2's batch split over
# both mesh axes with its sharded weight, LoRA's skinny rank; rows over one axis (replicated over
# the other), threefry, a weight whole.
LINEAR_CASES = [((16, 64, 256), (("data", "model"), None, None), ("data", None), "tiled"),
                ((4, 256, 128), ("data", None, None), None, "threefry")]


@pytest.mark.parametrize("shape,spec,weight_spec,impl", LINEAR_CASES, ids=["fsdp-v2-tiled", "rows-threefry"])
def test_dropout_linear_runs_per_shard_with_the_unsharded_mask(shape, spec, weight_spec, impl):
    """docs/lora.md: the fused kernels on each device's rows (one op call: no unfused dropout), the
    weight gathered whole, no activation gathered; the output and x's gradient equal the
    unsharded fused call's, the weight's gradient (the shards' sums, summed in order) within
    float32 rounding."""
    from torch_pallas.ops import dropout_linear as dropout_linear_ops

    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(shape, generator=generator), torch.randn(16, shape[-1], generator=generator) / 16

    def run(x, weight_spec=None):
        x.requires_grad_(True)
        w = weight.to(DEVICE).requires_grad_(True)
        if weight_spec is not None:
            xs.mark_sharding(w, mesh_of("2x2"), weight_spec)
        out = torch_pallas.dropout_linear(x, w, p=0.3, seed=3, impl=impl)
        out.square().sum().backward()
        return out, x.grad, w.grad

    expected, = read_together(run(x.to(DEVICE)))
    x_sharded = sharded(x, mesh_of("2x2"), spec)
    calls, apply = [], dropout_linear_ops.apply
    dropout_linear_ops.apply = lambda *args, **kwargs: calls.append(kwargs) or apply(*args, **kwargs)
    compiled_modules(lambda: torch_xla.sync())  # the inputs' transfer
    try:
        got = run(x_sharded, weight_spec)
    finally:
        dropout_linear_ops.apply = apply
    assert [call["sharding_text"] for call in calls] == [spec_of(x_sharded)]
    # Only the weight and its gradient's rows (one per shard) are gathered, never activations.
    assert all(size <= 4 * weight.numel() for size in all_gather_sizes(compiled_modules(lambda: torch_xla.sync())))
    out, grad_x, grad_w = got
    assert spec_of(grad_x) == spec_of(x_sharded)
    for name, a, b in zip(("output", "grad x"), (out, grad_x), expected):
        assert torch.equal(a.cpu(), b), name
    torch.testing.assert_close(grad_w.cpu(), expected[2], rtol=1e-5, atol=1e-5 * float(expected[2].abs().max()))


# (mesh, x's partition spec, the weight's): a weight sharded over the batch's axis is FSDP's.
# Batch, features, both, and the weight sharded too.
INDRNN_CASES = [("4x1", (None, "data", None), None), ("1x4", (None, None, "model"), None),
                ("2x2", (None, "data", "model"), None), ("4x1", (None, "data", None), ("data",))]


@pytest.mark.parametrize("mesh,spec,weight_spec", INDRNN_CASES, ids=[f"{m}-{s}-{w}" for m, s, w in INDRNN_CASES])
def test_indrnn_sharded_equals_unsharded(mesh, spec, weight_spec):
    T, B, F = 12, 8, 256
    generator = torch.Generator().manual_seed(0)
    x, h0 = torch.randn(T, B, F, generator=generator), torch.randn(B, F, generator=generator)
    weight = torch.rand(F, generator=generator) * 1.8 - 0.9
    lengths = torch.tensor([12, 5, 0, 3, 12, 1, 7, 11])

    def run(x, weight_spec=None):
        x.requires_grad_(True)
        w, h = weight.to(DEVICE).requires_grad_(True), h0.to(DEVICE).requires_grad_(True)
        if weight_spec is not None:
            xs.mark_sharding(w, mesh_of(mesh), weight_spec)
        output, h_n = torch_pallas.indrnn(x, w, h, nonlinearity="tanh", lengths=lengths)
        (output.square().sum() + h_n.sum()).backward()
        return output, h_n, x.grad, w.grad, h.grad

    expected, = read_together(run(x.to(DEVICE)))
    x_sharded = sharded(x, mesh_of(mesh), spec)
    modules = compiled_modules(lambda: torch_xla.sync())  # the inputs' transfer
    got = run(x_sharded, weight_spec)
    output, _, grad_x, grad_w, _ = got
    assert spec_of(output) == spec_of(x_sharded) == spec_of(grad_x)
    # The parameter's sharding: replicated, or FSDP's split.
    assert spec_of(grad_w) in (("", "{replicated}") if weight_spec is None else ("{devices=[4]0,1,2,3}",))
    modules = compiled_modules(lambda: torch_xla.sync())
    # Only the weight gradient's rows (one per batch shard) are gathered, never activations.
    assert all(size <= 4 * F for size in all_gather_sizes(modules))
    for name, a, b in zip(("output", "h_n", "grad x", "grad weight", "grad h0"), got, expected):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6 * float(b.abs().max()), msg=name)


def test_indrnn_batch_first_and_time_split():
    mesh = mesh_of("2x2")
    values, weight = torch.randn(8, 6, 256), torch.rand(256).to(DEVICE)
    x = sharded(values, mesh, ("data", None, "model"))  # (B, T, F)
    output, _ = torch_pallas.indrnn(x, weight, batch_first=True)
    torch_xla.sync()  # the transposed view's sharding is XLA's to propagate
    assert spec_of(output) == spec_of(x)
    expected, _ = torch_pallas.indrnn(values.to(DEVICE), weight, batch_first=True)
    torch.testing.assert_close(output.cpu(), expected.cpu(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="split along time"):
        torch_pallas.indrnn(sharded(torch.randn(8, 4, 256), mesh, ("data", None, None)), torch.ones(256, device=DEVICE))


SAMPLING_CASES = [("1x4", (None, "model")), ("2x2", ("data", "model"))]


@pytest.mark.parametrize("mesh,spec", SAMPLING_CASES, ids=[f"{m}-{s}" for m, s in SAMPLING_CASES])
def test_sampled_tokens_of_sharded_logits_are_the_unsharded_ones_without_gathering_them(mesh, spec):
    """A tensor-parallel lm_head's logits (split along the vocabulary), and the batch split too:
    the kernel runs on each shard, and the tokens are the unsharded call's."""
    values, arguments = sharded_logits_case()
    expected = torch_pallas.sample_tokens(values.to(DEVICE), **arguments)
    logits = sharded(values, mesh_of(mesh), spec)
    got = torch_pallas.sample_tokens(logits, **arguments)
    assert "SPMDFullToShardShape" in torch_xla._XLAC._get_xla_tensors_hlo([got.tokens])
    modules = compiled_modules(lambda: torch_xla.sync())
    assert got.tokens.cpu().tolist() == expected.tokens.cpu().tolist()
    torch.testing.assert_close(got.logprobs.cpu(), expected.logprobs.cpu(), rtol=0, atol=1e-5)
    torch.testing.assert_close(got.raw_logprobs.cpu(), expected.raw_logprobs.cpu(), rtol=0, atol=1e-5)
    # Per-row partials and the shards' best tokens only: (8, shards) at most, never logits.
    assert modules and all(size <= 8 * 4 for size in all_gather_sizes(modules)), all_gather_sizes(modules)


def test_errors_name_what_is_not_supported():
    mesh = mesh_of("2x2")
    with pytest.raises(ValueError, match="does not divide 15"):
        torch_pallas.dropout(sharded(torch.ones(15, 512), mesh, ("data", None)), 0.5)
    with pytest.raises(ValueError, match="give both"):
        torch_pallas.random.uniform((16, 512), mesh=mesh)
    with pytest.raises(ValueError, match="one entry per dim"):
        torch_pallas.random.uniform((16, 512), mesh=mesh, partition_spec=("data",))


def test_readme_spmd_snippet_runs():
    from test_readme import python_blocks
    (block,) = [block for block in python_blocks() if "use_spmd()" in block]
    namespace = {"torch": torch, "torch_xla": torch_xla, "torch_pallas": torch_pallas, "device": DEVICE}
    exec(compile(block, "README.md", "exec"), namespace)
    x, y, u = namespace["x"], namespace["y"], namespace["u"]
    assert spec_of(y) == spec_of(x) == Sharding_text(mesh_of("2x2"), ("data", None), (512, 1024))
    assert spec_of(u) == "{devices=[2,2]0,1,2,3}"
    unsharded = x.cpu().to(DEVICE)
    torch.testing.assert_close(y.cpu(), torch_pallas.dropout(unsharded, 0.1, seed=0).cpu(), rtol=0, atol=0)
    torch.testing.assert_close(u.cpu(), torch_pallas.random.uniform((64, 1024), seed=0).cpu(), rtol=0, atol=0)


def test_fsdp_v2_example_trains_compiled_and_matches_unsharded():
    """docs/sharding.md, torch_xla (train_fsdp.py): no compile after warm-up; losses == unsharded within rtol 1e-5."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import train_fsdp

    losses, compiles = train_fsdp.train(sharded=True, num_steps=6, warm_up=3)
    assert compiles == 0 and losses[-1] < losses[0]
    # The same model with every device holding the whole batch and every parameter.
    unsharded, _ = train_fsdp.train(sharded=False, num_steps=6, warm_up=3)
    np.testing.assert_allclose(losses, unsharded, rtol=1e-5)
    eager, _ = train_fsdp.train(sharded=True, compiled=False, num_steps=3)
    eager_unsharded, _ = train_fsdp.train(sharded=False, compiled=False, num_steps=3)
    np.testing.assert_allclose(eager, eager_unsharded, rtol=1e-5)


def test_dropout_module_with_a_partition_spec_runs_per_shard_under_compile():
    mesh, spec = mesh_of("2x2"), ("data", "model")
    values = torch.rand(16, 512) + 0.5
    x = values.to(DEVICE).requires_grad_(True)  # unmarked: the module's partition_spec shards it
    dropout = torch_pallas.nn.Dropout(0.3, mesh=mesh, partition_spec=spec)  # the default impl, tiled
    compiled = torch.compile(dropout, backend="openxla", fullgraph=True)
    torch_xla.manual_seed(2)
    y = compiled(x)
    y.backward(torch.ones_like(y))
    torch_xla.sync()
    keep = y.cpu() != 0
    torch_xla.manual_seed(2)
    unsharded = torch.compile(torch_pallas.nn.Dropout(0.3), backend="openxla", fullgraph=True)
    torch.testing.assert_close(y.cpu(), unsharded(values.to(DEVICE)).cpu(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad.cpu(), torch.where(keep, y.cpu() / values, 0), rtol=1e-6, atol=0)
    assert spec_of(y) == spec_of(x.grad) == Sharding_text(mesh, spec, (16, 512))
    assert abs(keep.float().mean().item() - 0.7) < 0.03


def test_convert_dropout_gives_its_dropout_modules_the_partition_spec():
    mesh, spec = mesh_of("2x2"), ("data", "model")
    model = torch_pallas.convert_dropout(torch.nn.Sequential(torch.nn.Dropout(0.3), torch.nn.Dropout1d(0.3)),
                                         mesh=mesh, partition_spec=spec)
    assert model[0].partition_spec == spec and getattr(model[1], "partition_spec", None) is None
    values = torch.rand(16, 512) + 0.5
    torch_xla.manual_seed(3)
    y = model[0](values.to(DEVICE))
    torch_xla.sync()
    assert spec_of(y) == Sharding_text(mesh, spec, (16, 512))
    torch_xla.manual_seed(3)
    torch.testing.assert_close(y.cpu(), torch_pallas.nn.Dropout(0.3)(values.to(DEVICE)).cpu(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="dims"):
        model[0](torch.ones(4, 16, 512, device=DEVICE))
    with pytest.raises(ValueError, match="go together"):
        torch_pallas.convert_dropout(torch.nn.Dropout(), mesh=mesh)


def test_function_mesh_arguments_under_compile_run_whole_with_the_same_mask():
    mesh = mesh_of("2x2")
    compiled = torch.compile(
        lambda x: torch_pallas.dropout(x, 0.3, seed=4, mesh=mesh, partition_spec=("data", "model")),
        backend="openxla", fullgraph=True)
    y = compiled(torch.ones(16, 512, device=DEVICE))
    torch.testing.assert_close(y.cpu(), torch_pallas.dropout(torch.ones(16, 512, device=DEVICE), 0.3, seed=4).cpu(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_modules_with_a_partition_spec_run_per_shard(compiled):
    mesh, spec = mesh_of("2x2"), ("data", None, "model")  # (B, T, F)
    torch.manual_seed(0)
    values = torch.randn(8, 6, 256)
    p = 0.2
    # Features split over "model": the default impl draws the shards in the bands of tiles that cover them.
    sharded_rnn = torch_pallas.nn.IndRNN(256, 256, num_layers=2, dropout=p, batch_first=True, mesh=mesh,
                                         partition_spec=spec).to(DEVICE)
    plain_rnn = torch_pallas.nn.IndRNN(256, 256, num_layers=2, dropout=p, batch_first=True).to(DEVICE)
    plain_rnn.load_state_dict(sharded_rnn.state_dict())
    dropout = torch_pallas.nn.Dropout(p, mesh=mesh, partition_spec=spec)
    assert "partition_spec=('data', None, 'model')" in repr(dropout)
    results = []
    for rnn, drop in ((sharded_rnn, dropout), (plain_rnn, torch_pallas.nn.Dropout(p))):
        torch._dynamo.reset()
        step = (lambda x: drop(rnn(x)[0]))
        step = torch.compile(step, backend="openxla") if compiled else step
        torch_xla.manual_seed(5)
        y = step(values.to(DEVICE))  # an unmarked input: the modules' partition_spec shards it
        y.sum().backward()
        torch_xla.sync()
        results.append((y, rnn.weight_hh_l1.grad, rnn.weight_ih_l0.grad))
    sharded, plain = results
    assert spec_of(sharded[0]) == Sharding_text(mesh, spec)
    for a, b in zip(sharded, plain):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="go together"):
        torch_pallas.nn.Dropout(0.1, mesh=mesh)


def Sharding_text(mesh, spec, shape=(8, 6, 256)):
    reference = torch.empty(shape).to(DEVICE)
    xs.mark_sharding(reference, mesh, spec)
    return spec_of(reference)


# (mesh, query's partition spec, GQA): batch, heads, both, and GQA heads split with the query's.
ATTENTION_CASES = [("4x1", ("data", None, None, None), False), ("1x4", (None, "model", None, None), False),
                   ("2x2", ("data", "model", None, None), True)]


@pytest.mark.parametrize("mesh,spec,gqa", ATTENTION_CASES, ids=[f"{m}-{s}-{g}" for m, s, g in ATTENTION_CASES])
def test_attention_runs_per_shard_with_the_unsharded_mask_and_no_all_gather(mesh, spec, gqa):
    """docs/sharding.md, What a kernel takes: attention split over batch and heads runs per shard; output and gradients
    equal the unsharded call's (the same mask), keep the sharding, and nothing is gathered."""
    query, key, value, mask, options = sharded_case(gqa)

    def attend(tensors, mask):
        out = torch_pallas.scaled_dot_product_attention(*tensors, attn_mask=mask, **options)
        grads = torch.autograd.grad(out.square().sum(), tensors)
        return out, grads

    plain = [t.to(DEVICE).requires_grad_() for t in (query, key, value)]
    expected_out, expected_grads = attend(plain, mask.to(DEVICE))
    torch_xla.sync()
    parts = [sharded(t, mesh_of(mesh), spec).requires_grad_() for t in (query, key, value)]
    results = []

    def run():
        out, grads = attend(parts, sharded(mask, mesh_of(mesh), (spec[0], None, None, None)))
        assert "SPMDFullToShardShape" in torch_xla._XLAC._get_xla_tensors_hlo([out])
        torch_xla.sync()
        results.extend([out, *grads])
    modules = compiled_modules(run)
    assert modules and all_gather_sizes(modules) == []
    out, *grads = results
    assert spec_of(out) == spec_of(parts[0]) and spec_of(grads[0]) == spec_of(parts[0])
    torch.testing.assert_close(out.cpu(), expected_out.cpu(), atol=1e-6, rtol=1e-5)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad.cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)


def test_attention_split_along_its_length_is_rejected():
    query = sharded(torch.randn(2, 2, 32, 16), mesh_of("1x4"), (None, None, "model", None))
    with pytest.raises(ValueError, match="split along its length or head dim"):
        torch_pallas.scaled_dot_product_attention(query, query, query)


@pytest.mark.parametrize("impl", ["threefry", None], ids=["threefry-fused", "default-unfused"])
def test_peft_lora_under_fsdp_v2_runs_each_lora_input_per_shard_as_unsharded(impl):
    """docs/lora.md#fsdp-v2: a PEFT LoRA model wrapped in FSDPv2 (its parameters sharded, the batch
    split over the fsdp axis), its dropouts converted with the activations' partition spec: under
    route_dropout() every lora_A(dropout(x)) is one fused call per device's rows (threefry; the
    default's fused kernel takes whole bands of its tiles, more rows than these shards: unfused),
    and the loss and the LoRA gradients equal the unsharded model's for the same XLA seed."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from torch_pallas.ops import dropout_linear as dropout_linear_ops

    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))

    def step(sharded: bool):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        split = dict(mesh=mesh, partition_spec=("fsdp", None, None)) if sharded else {}
        model = torch_pallas.convert_dropout(peft.get_peft_model(transformers.LlamaForCausalLM(config), lora),
                                             impl=impl, **split)
        model = model.to(DEVICE).train()
        if sharded:  # as transformers' Trainer wraps it for FSDPv2: each decoder layer, and the logits' split
            model = SpmdFullyShardedDataParallel(
                model, mesh=mesh, shard_output=lambda output, mesh: xs.mark_sharding(
                    getattr(output, "logits", output), mesh, ("fsdp", None, None)),
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                   transformer_layer_cls={LlamaDecoderLayer}))
        batch = ids.to(DEVICE)
        xs.mark_sharding(batch, mesh, ("fsdp" if sharded else None, None))
        torch_xla.manual_seed(0)
        with torch_pallas.route_dropout():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        grads = [p.grad for name, p in model.named_parameters() if p.requires_grad]
        return [loss, *grads]

    expected, = read_together(step(sharded=False))  # (each tensor read alone compiles a graph of its own)
    calls, apply = [], dropout_linear_ops.apply
    dropout_linear_ops.apply = lambda *args, **kwargs: calls.append(kwargs["sharding_text"]) or apply(*args, **kwargs)
    try:
        got = step(sharded=True)
    finally:
        dropout_linear_ops.apply = apply
    # threefry: one fused call per adapted layer, on the devices' rows
    assert (len(calls) == 7 and all(calls)) if impl == "threefry" else calls == [], calls
    got, = read_together(got)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert len(got) == len(expected) == 15
    for grad, reference in zip(got[1:], expected[1:]):
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-5 * float(reference.abs().max()))
